"""The connector's restore pipeline (kvgraft.integrations.vllm.restore) without an engine:
whatever the thread count, blocks in any order, from the machine cache or the memory tier,
the paged cache ends up holding exactly the graft's KV; a chunk altered in the machine
cache is refused, never copied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, UsageError
from kvgraft.formats.kvfile import write_kvfile
from kvgraft.formats.manifest import BlobRef
from kvgraft.integrations.vllm import paged, restore
from kvgraft.integrations.vllm.hot import HotChunks
from kvgraft.transfer.pull import Fetcher
from kvgraft.transfer.push import PushOptions
from tests.support.harness import RegistryFactory
from tests.support.synthetic import synthetic_identity, synthetic_layers

LAYERS, HEADS, DIM, BLOCK, CHUNK, TOKENS = 3, 2, 64, 32, 64, 256
Want = list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]
Graft = tuple[Registry, list[restore.Chunk], Want]


@pytest.fixture
def graft(make_registry: RegistryFactory, tmp_path: Path) -> Graft:
    layers = synthetic_layers(LAYERS, HEADS, DIM, TOKENS, seed=3)
    kv = write_kvfile(tmp_path / "g.kv", layers, list(range(TOKENS)), synthetic_identity(),
                      model_name="synthetic", model_config={"model_type": "synthetic"})
    reg = make_registry()
    digest = reg.push(kv, "r/g:v1", options=PushOptions(chunk_tokens=CHUNK)).digest
    chunks = [(c.start, c.end, str(c.digest), c.size) for c in reg.manifest(digest).chunks]
    want = [(np.frombuffer(k.data, np.int16).reshape(HEADS, TOKENS, DIM),
             np.frombuffer(v.data, np.int16).reshape(HEADS, TOKENS, DIM)) for k, v, _ in layers]
    return reg, chunks, want


def _restore(reg: Registry, chunks: list[restore.Chunk], threads: int, hot: HotChunks,
             blocks: list[int], start: int = 0, first: int = 0) -> list[paged.PagedLayer]:
    """Restore into fresh paged caches of the graft's layers from `first` on (a pipeline
    stage's)."""
    caches = [torch.zeros(len(blocks) + 3, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
              for _ in range(first, LAYERS)]
    views = [paged.block_view(c, HEADS, BLOCK, DIM, torch.bfloat16, isa="vec") for c in caches]
    reader = restore.Reader(Fetcher(reg.store, reg.cache, keep_decoded=True), hot,
                            restore.buffers(threads, max(c[3] for c in chunks), []))
    target = restore.Target(views, BLOCK, blocks, start, TOKENS, 2, slice(None), first)
    todo = [c for c in chunks if c[1] > start]
    done = restore.load(reader, target, todo, threads)
    assert sum(w for w, _ in done) == 2 * (LAYERS - first) * HEADS * DIM * (TOKENS - start) * 2
    return views


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_restore_writes_exactly_the_graft(graft: Graft, threads: int) -> None:
    reg, chunks, want = graft
    blocks = [9, 2, 3, 4, 0, 1, 7, 8]  # runs and strays, as vLLM hands them out
    hot = HotChunks(1 << 30)
    for _ in range(2):  # the machine cache (verified), then the memory tier
        views = _restore(reg, chunks, threads, hot, blocks)
        for view, (k, v) in zip(views, want, strict=True):
            gk, gv = paged.gather(view, blocks)
            assert np.array_equal(paged._ints(gk), k) and np.array_equal(paged._ints(gv), v)
    assert hot.hits == len(chunks)
    # a restore starting mid-prompt (vLLM had the first blocks): only the rest is written,
    # whether the chunks come from the machine cache or, in other blocks, from memory
    for tier, at in ((HotChunks(0), blocks), (hot, [4, 5, 6, 0, 1, 2, 3, 7])):
        views = _restore(reg, chunks, threads, tier, at, start=3 * BLOCK)
        for view, (k, v) in zip(views, want, strict=True):
            gk, gv = paged.gather(view, at[3:])
            assert np.array_equal(paged._ints(gk), k[:, 3 * BLOCK:])
            assert np.array_equal(paged._ints(gv), v[:, 3 * BLOCK:])
            assert not paged.gather(view, at[:3])[0].any()
    assert hot.hits == 2 * len(chunks) - 1  # the chunk wholly before the start is not read


def test_kept_blocks_that_do_not_cover_a_span_are_refused(graft: Graft) -> None:
    reg, chunks, _ = graft
    hot = HotChunks(1 << 30)
    views = _restore(reg, chunks, 1, hot, list(range(8)))
    kept = hot.get(chunks[0][2])
    assert kept is not None and len(kept) == LAYERS and len(kept[0]) == CHUNK // BLOCK
    with pytest.raises(UsageError, match="do not cover"):  # one block kept, two asked
        paged.put_rows(views, [0, 1], tuple(r[1:] for r in kept))
    with pytest.raises(UsageError, match="do not cover"):  # a layer short
        paged.put_rows(views, [0, 1], kept[1:])


def test_a_pipeline_stage_restores_its_own_layers(graft: Graft) -> None:
    reg, chunks, want = graft
    blocks = [5, 0, 1, 2, 3, 4, 6, 7]
    views = _restore(reg, chunks, 2, HotChunks(0), blocks, first=1)
    assert len(views) == LAYERS - 1
    for view, (k, v) in zip(views, want[1:], strict=True):
        gk, gv = paged.gather(view, blocks)
        assert np.array_equal(paged._ints(gk), k) and np.array_equal(paged._ints(gv), v)


def test_a_chunk_altered_on_disk_is_refused(graft: Graft) -> None:
    reg, chunks, _ = graft
    fetcher = Fetcher(reg.store, reg.cache, keep_decoded=True)
    for c in chunks:
        fetcher.get(BlobRef(Digest.parse(c[2]), c[3]))
    victim = Digest.parse(chunks[1][2])
    # the machine cache's copy and the store's (a cache miss refetches from the store)
    hits = [p for root in (Path(reg.cache.root), Path(reg.config.home) / "blobs")
            for p in root.rglob(victim.hex[2:] + "*") if p.is_file()]
    assert len(hits) >= 2
    for p in hits:
        data = bytearray(p.read_bytes())
        data[-1] ^= 1
        p.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        _restore(reg, chunks, 2, HotChunks(0), list(range(8)))

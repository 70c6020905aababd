"""The vLLM connector's restore pipeline (kvgraft.integrations.vllm.restore) at 1, 2 and all
threads, beside the machine's own limits measured in the same run: SHA-256 (hashlib, one
thread) and a memory copy (NumPy, one thread) of the same bytes.

Input: a SmolLM2-135M-shaped graft (30 layers, 3 KV heads, head dim 64, BF16) of `tokens`
tokens pushed into a local registry, its chunks (256 tokens) in the machine cache; the
restore reads each chunk from there (verified on every read: the worker's memory tier is
off), and copies it into a paged cache of 128-token blocks laid out as vLLM's CPU "vec"
kernels lay them out. Rows: {"bench": "restore_scaling", "threads", "tokens", "mb",
"seconds" (median of `repeats`), "mb_s" (KV bytes written into blocks per second),
"speedup" (over 1 thread), "sha256_mb_s", "memcpy_mb_s" (one thread each), "cores"}.
What 16 cores would give is the 2-thread speedup carried on until a limit (memory
bandwidth, or the chunks of one request) stops it: say so beside the figures.

    python -m benchmarks.restore_scaling [--tokens 8192] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

LAYERS, HEADS, DIM, BLOCK, CHUNK = 30, 3, 64, 128, 256

Report = Callable[[dict[str, Any]], None]


def _limits(nbytes: int) -> tuple[float, float]:
    """(SHA-256, memory copy) throughput of one thread over `nbytes`, MB/s (best of 3)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    sha = copy = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        hashlib.sha256(src.data).digest()
        sha = min(sha, time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(dst, src)
        copy = min(copy, time.perf_counter() - t)
    return nbytes / sha / 1e6, nbytes / copy / 1e6


def run(report: Report, tokens: int = 8192, repeats: int = 5) -> None:
    import torch

    from kvgraft.client import Registry
    from kvgraft.config import Config
    from kvgraft.integrations.vllm import paged, restore
    from kvgraft.integrations.vllm.hot import HotChunks
    from kvgraft.transfer.pull import Fetcher
    from kvgraft.transfer.push import PushOptions
    from tests.support.synthetic import write_synthetic

    with tempfile.TemporaryDirectory(prefix="kvgraft-restore-") as tmp:
        root = Path(tmp)
        kv = write_synthetic(root / "g.kv", num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM,
                             tokens=tokens, dtype="BF16", seed=7, name="bench")
        reg = Registry(Config.from_env({"KVGRAFT_HOME": str(root / "home")}))
        digest = reg.push(kv, "bench/restore:v1",
                          options=PushOptions(chunk_tokens=CHUNK)).digest
        manifest = reg.manifest(digest)
        chunks = [(c.start, c.end, str(c.digest), c.size) for c in manifest.chunks]
        fetcher = Fetcher(reg.store, reg.cache, keep_decoded=True)
        for c in chunks:  # into the machine cache, as a first restore leaves them
            fetcher.get(_ref(c))
        blocks = tokens // BLOCK
        caches = [torch.zeros(blocks, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
                  for _ in range(LAYERS)]
        views = [paged.block_view(c, HEADS, BLOCK, DIM, torch.bfloat16, isa="vec")
                 for c in caches]
        target = restore.Target(views, BLOCK, list(range(blocks)), 0, tokens, 2, slice(None))
        kept: list[bytearray] = []
        mb = 2 * LAYERS * HEADS * DIM * tokens * 2 / 1e6
        sha_mb_s, copy_mb_s = _limits(max(c[3] for c in chunks) * 8)
        cores = restore.default_threads()
        base = None
        for threads in sorted({1, 2, cores}):
            times = []
            for _ in range(repeats):
                reader = restore.Reader(fetcher, HotChunks(0),
                                        restore.buffers(threads, max(c[3] for c in chunks),
                                                        kept))
                t = time.perf_counter()
                restore.load(reader, target, chunks, threads)
                times.append(time.perf_counter() - t)
            seconds = statistics.median(times)
            base = base or seconds
            report({"bench": "restore_scaling", "threads": threads, "tokens": tokens,
                    "mb": round(mb, 1), "seconds": round(seconds, 4),
                    "mb_s": round(mb / seconds, 1), "speedup": round(base / seconds, 2),
                    "sha256_mb_s": round(sha_mb_s, 1), "memcpy_mb_s": round(copy_mb_s, 1),
                    "cores": os.cpu_count()})
        reg.close()


def _ref(c: tuple[int, int, str, int]) -> Any:
    from kvgraft.digest import Digest
    from kvgraft.formats.manifest import BlobRef

    return BlobRef(Digest.parse(c[2]), c[3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    run(lambda row: print(json.dumps(row), flush=True), args.tokens, args.repeats)


if __name__ == "__main__":
    main()

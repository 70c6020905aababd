"""The connector's worker side: restores the chunks the scheduler side planned into the
blocks vLLM allocated, and publishes the prompts the engine computed.

A restore reads each chunk back from memory or the machine cache (verified again on read)
and writes it into vLLM's paged blocks before the forward starts. Publishing (whole blocks)
copies the computed blocks out during the forward and stores them from a background
thread, off the request path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import QuotaExceeded, RegistryError
from kvgraft.formats.manifest import BlobRef
from kvgraft.integrations.vllm import paged
from kvgraft.integrations.vllm.common import Context, KvgraftMetadata, LoadSpec, SaveSpec
from kvgraft.integrations.vllm.hot import HotChunks, MiB
from kvgraft.integrations.vllm.identity import EngineIdentity
from kvgraft.integrations.vllm.store import publish
from kvgraft.transfer.pull import Fetcher

log = logging.getLogger("vllm.kvgraft")
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
LOAD_THREADS = 2  # threads of a restore, each reading, verifying and copying whole chunks

Chunk = tuple[int, int, str, int]  # (start, end, digest, size), as in a RestorePlan


def _unpin() -> None:
    """Let a restore thread run on every core this process may use. vLLM's CPU worker pins
    its thread to one core of its OpenMP set and new threads inherit that, so both restore
    threads would share one core while the OpenMP threads on the others wait for the
    forward. (On 2 cores vLLM keeps the second for its engine process, whose busy-wait
    holds it while the worker runs: measured no faster there.) Only the calling thread's
    mask changes (pid 0 is the calling thread on Linux): vLLM's own threads keep theirs."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


@dataclass
class _Reader:
    """Verified chunk bytes for the restore threads: from memory, else from the machine
    cache (or the store), into memory when it has room, else into a free buffer."""

    fetcher: Fetcher
    hot: HotChunks
    free: queue.SimpleQueue[bytearray]  # as many buffers as threads: get never waits

    def read(self, digest: str, n: int, buf: bytearray) -> memoryview:
        kept = self.hot.get(digest)
        if kept is not None:
            return memoryview(kept)
        into = bytearray(n) if n <= self.hot.capacity else buf
        data, _ = self.fetcher.get(BlobRef(Digest.parse(digest), n), memoryview(into)[:n])
        if into is not buf:
            self.hot.put(digest, into)
        return memoryview(data)


class KvgraftConnectorWorker:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._views: list[paged.PagedLayer] = []
        self._saving: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._load_errors: set[int] = set()
        self._bufs: list[bytearray] = []
        self._hot = HotChunks(ctx.settings.memory_cache_mb * MiB)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ident = self.ctx.ident
        if ident is None:
            return
        try:
            names = sorted(kv_caches, key=lambda n: int(_LAYER_INDEX.search(n).group(1)  # type: ignore[union-attr]
                                                        ))
            if len(names) != ident.layers:
                raise RegistryError(f"{len(names)} paged KV layers, model has {ident.layers}")
            dtype = paged.TORCH_DTYPES[ident.kv_dtype]
            self._views = [paged.block_view(kv_caches[n], ident.kv_heads, self.ctx.block,
                                            ident.head_dim, dtype) for n in names]
        except Exception as e:
            self.ctx.disable("connector disabled (paged KV layout)", e)

    def start_load_kv(self, meta: KvgraftMetadata) -> None:
        for spec in meta.loads:
            try:
                self._load(spec)
            except Exception as e:
                # The blocks hold nothing trustworthy: vLLM recomputes them
                # (kv_load_failure_policy "recompute") or fails the request ("fail").
                self._load_errors.update(spec.block_ids[spec.start // self.ctx.block:])
                self.ctx.fallback(spec.req_id, spec.plan.digest, e)

    def _load(self, spec: LoadSpec) -> None:
        registry, ident = self.ctx.registry, self.ctx.ident
        if registry is None or ident is None or not self._views:
            raise RegistryError("connector disabled")
        t0 = time.perf_counter()
        todo = [c for c in spec.plan.chunks
                if max(c[0], spec.start) < min(c[1], spec.plan.end)]
        reader = _Reader(Fetcher(registry.store, registry.cache, keep_decoded=True),
                         self._hot, self._buffers(max(c[3] for c in todo)))
        dtype = paged.TORCH_DTYPES[ident.kv_dtype]
        hits0 = self._hot.hits
        # Each chunk is read, verified and copied by one of two threads: SHA-256 and
        # torch's copies release the GIL, and chunks fill disjoint blocks.
        with ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kvgraft-load",
                                initializer=_unpin) as pool:
            done = list(pool.map(lambda c: self._load_chunk(reader, spec, c, dtype), todo))
        # hits: approximate if two restores overlap (a log figure)
        self._loaded(spec, done, time.perf_counter() - t0, self._hot.hits - hits0, len(todo))

    def _buffers(self, size: int) -> queue.SimpleQueue[bytearray]:
        """One reusable buffer per restore thread, each of at least `size` bytes."""
        if len(self._bufs) < LOAD_THREADS or len(self._bufs[0]) < size:
            self._bufs = [bytearray(size) for _ in range(LOAD_THREADS)]
        free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for buf in self._bufs[:LOAD_THREADS]:
            free.put(buf)
        return free

    def _load_chunk(self, reader: _Reader, spec: LoadSpec, chunk: Chunk,
                    dtype: torch.dtype) -> tuple[int, float]:
        """Read, verify and copy one chunk into its blocks: (bytes written, seconds
        reading and verifying)."""
        c_start, c_end, digest, n = chunk
        buf = reader.free.get()
        try:
            tr = time.perf_counter()
            view = reader.read(digest, n, buf)
            tr = time.perf_counter() - tr
            lo, hi = max(c_start, spec.start), min(c_end, spec.plan.end)
            blocks = spec.block_ids[lo // self.ctx.block : hi // self.ctx.block]
            return self._write(view, blocks, lo - c_start, hi - c_start, dtype), tr
        finally:
            reader.free.put(buf)

    def _write(self, view: memoryview, blocks: list[int], a: int, b: int,
               dtype: torch.dtype) -> int:
        """Copy tokens [a, b) of a chunk (a KV file's bytes) into `blocks`, every layer;
        bytes written."""
        hlen = int.from_bytes(view[:8], "little")
        header = json.loads(bytes(view[8 : 8 + hlen]))
        base = 8 + hlen
        size = torch.empty(0, dtype=dtype).element_size()
        written = 0
        for i, dst in enumerate(self._views):
            kv = []
            for part in ("key", "value"):
                entry = header[f"layers.{i}.{part}"]
                t = paged.array_from(view, base + entry["data_offsets"][0],
                                     tuple(entry["shape"]), size)
                kv.append(t[:, a:b])
            paged.scatter(dst, blocks, kv[0], kv[1])
            written += 2 * kv[0].nbytes
        return written

    def _loaded(self, spec: LoadSpec, done: list[tuple[int, float]], seconds: float,
                in_memory: int, chunks: int) -> None:
        written = sum(w for w, _ in done)
        waited = sum(r for _, r in done)
        tokens = spec.plan.end - spec.start
        self.ctx.counters.add("restored")
        self.ctx.counters.add("restored_tokens", tokens)
        log.info("kvgraft: restored %d tokens of %s into %d blocks (%.1f MB in %.4f s; "
                 "%.4f thread-s reading and verifying chunks, the rest copying; "
                 "%d of %d chunks from memory)",
                 tokens, spec.plan.digest, len(spec.block_ids),
                 written / 1e6, seconds, waited, in_memory, chunks)
        self.ctx.record("restore", spec.plan.digest, "ok", {
            "request": spec.req_id, "tokens": tokens,
            "prefix_tokens": spec.plan.end, "bytes": written, "seconds": round(seconds, 6),
            "cross_engine": spec.plan.cross_engine})

    def save_kv_layer(self, meta: KvgraftMetadata, layer_name: str) -> None:
        if not meta.saves or self.ctx.ident is None:
            return
        m = _LAYER_INDEX.search(layer_name)
        if m is None:
            return
        view = self._views[int(m.group(1))]
        for spec in meta.saves:
            self._saving.setdefault(spec.req_id, []).append(
                paged.gather(view, spec.block_ids))

    def wait_for_save(self, meta: KvgraftMetadata) -> None:
        if not meta.saves:
            return
        registry = self.ctx.registry
        for spec in meta.saves:
            layers = self._saving.pop(spec.req_id, [])
            ident = self.ctx.keyed(spec.key)
            if registry is None or ident is None or len(layers) != ident.layers:
                continue
            self.ctx.bg.submit("publish", self._publisher(registry, ident, spec, layers))

    def _publisher(self, registry: Registry, ident: EngineIdentity, spec: SaveSpec,
                   layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        repository, chunk = self.ctx.repository, self.ctx.chunk

        def job() -> None:
            t0 = time.perf_counter()
            try:
                digest = publish(registry, ident, repository, chunk, spec.token_ids, layers)
            except QuotaExceeded as e:  # the repository is full of pinned grafts
                self.ctx.counters.add("dropped.quota")
                log.warning("kvgraft: request %s not published: %s", spec.req_id, e)
                return
            self.ctx.counters.add("published")
            log.info("kvgraft: published %d tokens of request %s as %s@%s (%.3f s)",
                     len(spec.token_ids), spec.req_id, repository, digest,
                     time.perf_counter() - t0)
        return job

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self.ctx.close()

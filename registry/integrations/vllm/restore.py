"""A restore's pipeline: each chunk kept in the worker's memory is copied into the blocks
vLLM allocated as it lies (a copy per run of blocks and layer); any other is read from the
machine cache or the store, verified, converted into the blocks layer by layer, and its
blocks' bytes then kept in memory for the next restore. Chunks are independent and fill
disjoint blocks, so threads take whole chunks: SHA-256 (hashlib), zstd and the NumPy copies
release the GIL, and the threads' buffers bound the memory a restore holds beyond the
memory tier (one chunk a thread).

`python -m benchmarks.restore_scaling` measures it at 1, 2 and all threads beside SHA-256
and memory copy throughput on the same machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from time import perf_counter

from kvgraft.digest import Digest
from kvgraft.formats.manifest import BlobRef
from kvgraft.integrations.vllm import paged
from kvgraft.integrations.vllm.hot import HotChunks
from kvgraft.transfer.pull import Fetcher

MAX_THREADS = 16  # beyond, a restore is bound by memory bandwidth, not by cores

Chunk = tuple[int, int, str, int]  # (start, end, digest, size), as in a RestorePlan


def default_threads() -> int:
    """As many as the cores this process may use (at least 2: one reads while one copies)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(2, min(MAX_THREADS, cores))


def _unpin() -> None:
    """Let a restore thread run on every core this process may use. vLLM's CPU worker pins
    its thread to one core of its OpenMP set and new threads inherit that, so the restore
    threads would share one core while the OpenMP threads on the others wait for the
    forward. Only the calling thread's mask changes (pid 0 is the calling thread on
    Linux): vLLM's own threads keep theirs."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


@dataclass(frozen=True, slots=True)
class Reader:
    """Where the restore threads find chunks: restored before (`hot`), else verified from
    the machine cache (or the store) into a free buffer."""

    fetcher: Fetcher
    hot: HotChunks
    free: queue.SimpleQueue[bytearray]  # as many buffers as threads: get never waits


@dataclass(frozen=True, slots=True)
class Target:
    """Where a restore writes: every layer's paged cache, the request's blocks, and the
    span of prompt tokens [start, end) to fill."""

    views: Sequence[paged.PagedLayer]
    block_size: int
    block_ids: Sequence[int]
    start: int
    end: int
    itemsize: int  # bytes of one KV element
    heads: slice  # the graft's KV heads the views hold (a tensor-parallel rank's own)
    first: int = 0  # the graft's layer the first view holds (a pipeline stage's first)


def load(reader: Reader, target: Target, chunks: Sequence[Chunk],
         threads: int) -> list[tuple[int, float]]:
    """Read, verify and copy `chunks` into `target`: (bytes written, seconds reading and
    verifying) of each chunk. `reader.free` holds at least `threads` buffers."""
    with ThreadPoolExecutor(threads, thread_name_prefix="kvgraft-load",
                            initializer=_unpin) as pool:
        return list(pool.map(lambda c: _load_chunk(reader, target, c), chunks))


def buffers(count: int, size: int, kept: list[bytearray]) -> queue.SimpleQueue[bytearray]:
    """`count` reusable buffers of at least `size` bytes (`kept` reused, grown if needed)."""
    if len(kept) < count or len(kept[0]) < size:
        kept[:] = [bytearray(size) for _ in range(count)]
    free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
    for buf in kept[:count]:
        free.put(buf)
    return free


def _load_chunk(reader: Reader, target: Target, chunk: Chunk) -> tuple[int, float]:
    c_start, c_end, digest, n = chunk
    lo, hi = max(c_start, target.start), min(c_end, target.end)
    bs = target.block_size
    blocks = target.block_ids[lo // bs : hi // bs]
    kept = reader.hot.get(digest)
    if kept is not None:
        return paged.put_rows(target.views, blocks, kept, (lo - c_start) // bs), 0.0
    buf = reader.free.get()
    try:
        tr = perf_counter()
        data, _ = reader.fetcher.get(BlobRef(Digest.parse(digest), n), memoryview(buf)[:n])
        view = memoryview(data)
        tr = perf_counter() - tr
        written = write(view, target.views, blocks, lo - c_start, hi - c_start,
                        target.itemsize, target.heads, target.first)
    finally:
        reader.free.put(buf)
    # Kept only whole: a later restore may need any part of the chunk (a chunk's span is
    # whole blocks: the connector aligns chunks to the block size).
    if (lo, hi) == (c_start, c_end) and reader.hot.fits(written):
        reader.hot.put(digest, paged.take_rows(target.views, blocks))
    return written, tr


def write(view: memoryview, layers: Sequence[paged.PagedLayer], blocks: Sequence[int],
          a: int, b: int, itemsize: int, heads: slice, first: int = 0) -> int:
    """Copy tokens [a, b) of a chunk (a KV file's bytes), KV heads `heads` of it, into
    `blocks`, the chunk's layers from `first` on into `layers`; bytes written."""
    hlen = int.from_bytes(view[:8], "little")
    header = json.loads(bytes(view[8 : 8 + hlen]))
    base = 8 + hlen
    written = 0
    for i, dst in enumerate(layers):
        kv = []
        for part in ("key", "value"):
            entry = header[f"layers.{first + i}.{part}"]
            t = paged.array_from(view, base + entry["data_offsets"][0],
                                 tuple(entry["shape"]), itemsize)
            kv.append(t[heads, a:b])
        paged.scatter(dst, blocks, kv[0], kv[1])
        written += 2 * kv[0].nbytes
    return written

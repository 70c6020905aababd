"""A graft's KV file in memory, every byte verified, for the engines that restore it.

The first load assembles the file from its verified chunk blobs and keeps it in the machine
cache as one raw blob under the file digest; later loads map that blob and re-verify it
chunk by chunk (each chunk's payload hashed from its runs in place, on worker threads,
against the manifest's chunk digests), so a restore never trusts bytes it did not check.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvgraft.codecs.codec import parse_frame
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError
from kvgraft.formats.chunks import ChunkPlan, manifest_plans
from kvgraft.formats.kvfile import KVLayout
from kvgraft.formats.manifest import BlobRef, Manifest
from kvgraft.transfer.cache import Cache
from kvgraft.transfer.pull import Fetcher, layout_of

KVBuffer = bytearray | mmap.mmap  # a KV file's bytes in memory
# Given the buffer a KV file is read into (layout, buffer, offset of the file in it), a
# function called with each token range [start, end) once every byte of it is verified there
Filler = Callable[[KVLayout, KVBuffer, int], Callable[[int, int], None]]


def _verify(manifest: Manifest, plans: list[ChunkPlan], layout: KVLayout, view: memoryview,
            workers: int, verified: Callable[[int, int], None] | None) -> bool:
    """Every byte of an assembled KV file against the manifest: the header and token ids
    blob digests, and each chunk's digest over its payload header and its runs read in place
    (the plans cover the file exactly once), hashed on `workers` threads (hashlib releases
    the GIL); `verified(start, end)` on the same thread after each chunk that matches, while
    its bytes are still in the CPU's caches. The same check for every manifest version: it
    needs only blob digests."""
    tokens = view[layout.token_ids.begin : layout.token_ids.end]
    jobs: list[tuple[Digest, list[memoryview | bytes], ChunkPlan | None]] = [
        (manifest.header.digest, [view[: layout.header_size]], None),
        (manifest.tokens.digest, [tokens], None)]
    for plan, chunk in zip(plans, manifest.chunks, strict=True):
        jobs.append((chunk.digest, [plan.header, *(view[r.file_offset : r.file_offset + r.length]
                                                   for r in plan.runs)], plan))

    def check(job: tuple[Digest, list[memoryview | bytes], ChunkPlan | None]) -> bool:
        want, parts, plan = job
        if Digest.of(*parts) != want:
            return False
        if plan is not None and verified is not None:
            verified(plan.start, plan.end)
        return True

    with ThreadPoolExecutor(workers, thread_name_prefix="kvgraft-verify") as pool:
        return all(list(pool.map(check, jobs)))


def _assemble(manifest: Manifest, plans: list[ChunkPlan], layout: KVLayout, fetcher: Fetcher,
              view: memoryview, workers: int, verified: Callable[[int, int], None] | None,
              ) -> None:
    """Scatter the verified chunk blobs of `manifest` into `view` (the KV file's bytes)."""
    tokens, _ = fetcher.get(manifest.tokens)
    view[layout.token_ids.begin : layout.token_ids.end] = tokens
    places: dict[Digest, list[int]] = {}
    for i, c in enumerate(manifest.chunks):
        places.setdefault(c.digest, []).append(i)

    def place(digest: Digest) -> None:
        first = plans[places[digest][0]]
        data, _ = fetcher.get(BlobRef(digest, first.size))
        payload = memoryview(data)
        for i in places[digest]:
            plan = plans[i]
            if bytes(payload[: len(plan.header)]) != plan.header:
                raise IntegrityError(f"chunk {digest} does not have the layout its manifest "
                                     "describes")
            for r in plan.runs:
                view[r.file_offset : r.file_offset + r.length] = \
                    payload[r.offset : r.offset + r.length]
            if verified is not None:
                verified(plan.start, plan.end)

    with ThreadPoolExecutor(workers, thread_name_prefix="kvgraft-graft") as pool:
        for fut in [pool.submit(place, d) for d in places]:
            fut.result()


_Planned = tuple[KVLayout, list[ChunkPlan], int]  # layout, chunk plans, their runs
_PLANNED: OrderedDict[tuple[Digest, Digest], _Planned] = OrderedDict()
# Bounded by runs, not entries: a long graft of a wide model has hundreds of thousands
# (~70 bytes each), a 2048-token SmolLM2 graft 1,440.
_PLANNED_MAX_RUNS = 250_000
_planned_runs = 0
_planned_lock = threading.Lock()


def _plan(manifest: Manifest, fetcher: Fetcher) -> tuple[KVLayout, list[ChunkPlan]]:
    """The layout and chunk plans of `manifest`, remembered by its digest and its header
    blob's (they fix both), least recently used first out: reading and checking the header
    and planning the chunks cost ~5 ms of a 2048-token restore from the machine cache here,
    every time the same."""
    global _planned_runs
    key = (manifest.digest, manifest.header.digest)
    with _planned_lock:
        hit = _PLANNED.get(key)
        if hit is not None:
            _PLANNED.move_to_end(key)
            return hit[0], hit[1]
    header, _ = fetcher.get(manifest.header)
    layout = layout_of(manifest, header)
    plans = manifest_plans(manifest, layout)
    runs = sum(len(p.runs) for p in plans)
    with _planned_lock:
        if key not in _PLANNED and runs <= _PLANNED_MAX_RUNS:
            _PLANNED[key] = (layout, plans, runs)
            _planned_runs += runs
            while _planned_runs > _PLANNED_MAX_RUNS:
                _planned_runs -= _PLANNED.popitem(last=False)[1][2]
    return layout, plans


def _read_materialised(cache: Cache, manifest: Manifest) -> tuple[mmap.mmap, int] | None:
    """(mapping, offset of the KV file in it) of the assembled file kept in the cache.

    A private copy-on-write mapping: pages come straight from the page cache (a fresh
    buffer and a copy would cost more than hashing it), and the tensors built over it are
    writable without touching the file. Cache entries are replaced by rename, never
    rewritten in place, so a mapped file cannot change under us."""
    try:
        f = cache.blobs.open(manifest.file_digest)
    except LookupError:
        return None
    with f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):
            return None
    with contextlib.suppress(AttributeError, OSError):
        mapped.madvise(mmap.MADV_WILLNEED)
    try:
        codec, decoded, body = parse_frame(memoryview(mapped))
    except IntegrityError:
        return None
    base = len(mapped) - body.nbytes
    body.release()
    if codec != "raw" or decoded != manifest.file_size or len(mapped) - base != decoded:
        return None
    return mapped, base


def read_kv(manifest: Manifest, fetcher: Fetcher, *, workers: int = 2, keep: bool = True,
            fill: Filler | None = None) -> tuple[KVLayout, KVBuffer, int]:
    """The KV file of `manifest` in memory, every byte verified: (layout, buffer, offset
    of the file in the buffer).

    The first load assembles it from the chunk blobs (each verified as it is read, so the
    bytes are hashed once) and, with `keep`, keeps the assembled file in the cache as a raw
    blob under the file digest, so later loads skip decompression; those re-verify every
    chunk on read. The cache's prune drops it with everything else and it is rebuilt on
    demand.

    `fill(layout, buffer, offset)` lets a caller convert the file while it is verified: it
    is called once the buffer is chosen (again if a kept copy fails its check and the file
    is rebuilt in a new one) and returns the function called, on the worker threads, with
    each chunk's token range as soon as its bytes in that buffer are verified. What it
    builds is only trustworthy once read_kv returns."""
    layout, plans = _plan(manifest, fetcher)
    kept = _read_materialised(fetcher.cache, manifest)
    if kept is not None:
        mapped, base = kept
        verified = fill(layout, mapped, base) if fill is not None else None
        with memoryview(mapped) as view:
            good = _verify(manifest, plans, layout, view[base:], workers, verified)
        if good:
            return layout, mapped, base
        fetcher.cache.blobs.delete(manifest.file_digest)  # torn or tampered: rebuild it
    buf = bytearray(manifest.file_size)
    view = memoryview(buf)
    header, _ = fetcher.get(manifest.header)
    view[: layout.header_size] = header
    # Not hashed again: as in pull, every byte comes from a verified blob at a place the
    # verified header gives, and the plans cover the file exactly once (manifest_plans).
    _assemble(manifest, plans, layout, fetcher, view, workers,
              fill(layout, buf, 0) if fill is not None else None)
    if keep:
        fetcher.cache.put(manifest.file_digest, buf)
    return layout, buf, 0

"""A graft's KV file in memory, every byte verified, for the engines that restore it.

The first load assembles the file from its verified chunk blobs and keeps it in the machine
cache as one raw blob under the file digest; later loads map that blob and re-verify it
chunk by chunk (each chunk's payload hashed from its runs in place, on worker threads,
against the manifest's chunk digests), so a restore never trusts bytes it did not check.
"""

from __future__ import annotations

import contextlib
import mmap
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


def _verify(manifest: Manifest, plans: list[ChunkPlan], layout: KVLayout, view: memoryview,
            workers: int) -> bool:
    """Every byte of an assembled KV file against the manifest: the header and token ids
    blob digests, and each chunk's digest over its payload header and its runs read in place
    (the plans cover the file exactly once), hashed on `workers` threads (hashlib releases
    the GIL). The same check for every manifest version: it needs only blob digests."""
    tokens = view[layout.token_ids.begin : layout.token_ids.end]
    jobs: list[tuple[Digest, list[memoryview | bytes]]] = [
        (manifest.header.digest, [view[: layout.header_size]]),
        (manifest.tokens.digest, [tokens])]
    for plan, chunk in zip(plans, manifest.chunks, strict=True):
        jobs.append((chunk.digest, [plan.header, *(view[r.file_offset : r.file_offset + r.length]
                                                   for r in plan.runs)]))
    with ThreadPoolExecutor(workers, thread_name_prefix="kvgraft-verify") as pool:
        got = list(pool.map(lambda job: Digest.of(*job[1]), jobs))
    return all(g == want for g, (want, _) in zip(got, jobs, strict=True))


def _assemble(manifest: Manifest, plans: list[ChunkPlan], layout: KVLayout, fetcher: Fetcher,
              view: memoryview, workers: int) -> None:
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

    with ThreadPoolExecutor(workers, thread_name_prefix="kvgraft-graft") as pool:
        for fut in [pool.submit(place, d) for d in places]:
            fut.result()


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
            ) -> tuple[KVLayout, KVBuffer, int]:
    """The KV file of `manifest` in memory, every byte verified: (layout, buffer, offset
    of the file in the buffer).

    The first load assembles it from the chunk blobs (each verified as it is read, so the
    bytes are hashed once) and, with `keep`, keeps the assembled file in the cache as a raw
    blob under the file digest, so later loads skip decompression; those re-verify every
    chunk on read. The cache's prune drops it with everything else and it is rebuilt on
    demand."""
    header, _ = fetcher.get(manifest.header)
    layout = layout_of(manifest, header)
    plans = manifest_plans(manifest, layout)
    kept = _read_materialised(fetcher.cache, manifest)
    if kept is not None:
        mapped, base = kept
        with memoryview(mapped) as view:
            good = _verify(manifest, plans, layout, view[base:], workers)
        if good:
            return layout, mapped, base
        fetcher.cache.blobs.delete(manifest.file_digest)  # torn or tampered: rebuild it
    buf = bytearray(manifest.file_size)
    view = memoryview(buf)
    view[: layout.header_size] = header
    # Not hashed again: as in pull, every byte comes from a verified blob at a place the
    # verified header gives, and the plans cover the file exactly once (manifest_plans).
    _assemble(manifest, plans, layout, fetcher, view, workers)
    if keep:
        fetcher.cache.put(manifest.file_digest, buf)
    return layout, buf, 0

"""Pull: fetch an artifact's blobs into the machine cache, verified, and rebuild the file.

Every blob is decoded (bounded by the size the manifest declares) and hashed against its
key before anything uses it; the rebuilt file is hashed again against the manifest before
it is renamed into place, so nothing unverified is ever returned.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from registry.blobstore.base import BlobStore
from registry.cache import Cache
from registry.chunks import ChunkPlan, plan_chunks, scatter_many
from registry.codec import decode_blob
from registry.digest import Buffer, Digest
from registry.errors import IntegrityError, NotFound, RegistryError
from registry.fsutil import fsync_dir
from registry.kvfile import KVLayout, parse_header
from registry.manifest import BlobRef, Manifest

Progress = Callable[[int], None]
SCATTER_BATCH = 8  # decoded chunks held to coalesce their writes (memory: 8 chunks)


@dataclass(frozen=True, slots=True)
class FetchStats:
    fetched: int = 0  # blobs transferred from the store
    fetched_bytes: int = 0  # their stored bytes
    cached: int = 0  # blobs already in the cache


class Fetcher:
    """Gets verified decoded blobs: from the cache, else from the store into the cache."""

    def __init__(self, store: BlobStore | None, cache: Cache) -> None:
        self.store = store
        self.cache = cache
        self._lock = threading.Lock()
        self._fetched = self._bytes = self._hits = 0

    @property
    def stats(self) -> FetchStats:
        return FetchStats(self._fetched, self._bytes, self._hits)

    def _count(self, stored: int) -> None:
        with self._lock:
            if stored:
                self._fetched += 1
                self._bytes += stored
            else:
                self._hits += 1

    def get(self, ref: BlobRef) -> tuple[Buffer, int]:
        """(decoded bytes, stored bytes transferred: 0 on a cache hit)."""
        data = self.cache.get(ref.digest, ref.size)
        if data is not None:
            self._count(0)
            return data, 0
        if self.store is None:
            raise NotFound(f"blob {ref.digest} is not in the cache and kvgraft is offline",
                           hint="pull it once online first")
        with self.cache.lock(ref.digest):
            # Another process may have fetched it while we waited for the lock.
            data = self.cache.get(ref.digest, ref.size)
            if data is not None:
                self._count(0)
                return data, 0
            stored = self.store.get(ref.digest)
            data = verify_stored(ref, stored, self.store.url)
            self.cache.put_stored(ref.digest, stored)
        self._count(len(stored))
        return data, len(stored)


def verify_stored(ref: BlobRef, stored: Buffer, where: str) -> Buffer:
    """Decode a stored blob and check it against its reference; IntegrityError names it."""
    try:
        _, data = decode_blob(stored, ref.size)
        ref.digest.check(Digest.of(data), "decoded content")
    except IntegrityError as e:
        raise IntegrityError(
            f"blob {ref.digest} in {where} is corrupt: {e.message}",
            hint="run `kvgraft verify --all`; re-push the file to repair") from None
    return data


def fetch(manifest: Manifest, fetcher: Fetcher, *, workers: int = 2,
          progress: Progress | None = None) -> FetchStats:
    """Make sure every blob of `manifest` is in the cache (present entries are trusted
    here and verified whenever they are read)."""
    blobs = manifest.blobs()
    missing = [b for b in blobs if not fetcher.cache.has(b.digest)]
    for ref, _ in _map(fetcher.get, missing, workers):
        if progress:
            progress(ref.size)
    if progress:
        progress(sum(b.size for b in blobs if b not in missing))
    stats = fetcher.stats
    return FetchStats(stats.fetched, stats.fetched_bytes, stats.cached + len(blobs) - len(missing))


def _map(fn: Callable[[BlobRef], tuple[Buffer, int]], refs: list[BlobRef],
         workers: int) -> Iterator[tuple[BlobRef, tuple[Buffer, int]]]:
    with ThreadPoolExecutor(workers, thread_name_prefix="kvgraft-pull") as pool:
        window = 2 * workers
        futs = [(r, pool.submit(fn, r)) for r in refs[:window]]
        nxt = window
        while futs:
            ref, fut = futs.pop(0)
            result = fut.result()
            if nxt < len(refs):
                futs.append((refs[nxt], pool.submit(fn, refs[nxt])))
                nxt += 1
            yield ref, result


def file_digest_of(fd: int, size: int, block: int = 8 << 20) -> Digest:
    h = hashlib.sha256()
    buf = bytearray(block)
    view = memoryview(buf)
    pos = 0
    while pos < size:
        n = os.preadv(fd, [view[: min(block, size - pos)]], pos)
        if n <= 0:
            raise IntegrityError("rebuilt file is shorter than its manifest says")
        h.update(view[:n])
        pos += n
    return Digest.from_hasher(h)


def layout_of(manifest: Manifest, header: Buffer) -> KVLayout:
    raw = bytes(memoryview(header)[8:])
    try:
        layout = parse_header(raw, manifest.file_size, f"artifact {manifest.digest}")
    except RegistryError as e:
        raise IntegrityError(f"header blob of {manifest.digest}: {e.message}") from None
    if layout.token_count != manifest.token_count:
        raise IntegrityError("header blob disagrees with the manifest on the token count")
    return layout


def export(manifest: Manifest, fetcher: Fetcher, output: Path, *, workers: int = 2,
           progress: Progress | None = None) -> FetchStats:
    """Rebuild the pushed KV file at `output`, byte for byte, atomically."""
    header, _ = fetcher.get(manifest.header)
    layout = layout_of(manifest, header)
    plans = plan_chunks(layout, manifest.chunk_tokens)
    if [(p.start, p.end, p.size) for p in plans] != \
            [(c.start, c.end, c.size) for c in manifest.chunks]:
        raise IntegrityError(f"manifest {manifest.digest} chunks do not match its header")
    plan_of = {c.digest: p for c, p in zip(manifest.chunks, plans, strict=True)}
    places: dict[Digest, list[int]] = {}
    for i, c in enumerate(manifest.chunks):
        places.setdefault(c.digest, []).append(i)
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent)
    try:
        os.ftruncate(fd, manifest.file_size)
        os.pwrite(fd, header, 0)
        tokens, _ = fetcher.get(manifest.tokens)
        os.pwrite(fd, tokens, layout.token_ids.begin)

        chunk_refs = [BlobRef(d, plan_of[d].size) for d in places]
        batch: list[tuple[ChunkPlan, memoryview]] = []
        for ref, (data, _) in _map(fetcher.get, chunk_refs, workers):
            view = memoryview(data)
            for i in places[ref.digest]:
                plan = plans[i]
                if bytes(view[: len(plan.header)]) != plan.header:
                    raise IntegrityError(f"chunk {ref.digest} does not have the layout its "
                                         "manifest describes")
                batch.append((plan, view))
            if len(batch) >= SCATTER_BATCH:
                scatter_many(fd, batch)
                batch.clear()
            if progress:
                progress(ref.size * len(places[ref.digest]))
        scatter_many(fd, batch)
        # Every chunk was verified on the way in; this pass checks the assembly itself.
        # The file digest covers each tensor's bytes, so tensor digests need no second pass.
        # Flushing to disk and re-reading from the page cache overlap (both drop the GIL).
        with ThreadPoolExecutor(1, thread_name_prefix="kvgraft-fsync") as pool:
            synced = pool.submit(os.fsync, fd)
            digest = file_digest_of(fd, manifest.file_size)
            synced.result()
        manifest.file_digest.check(digest, f"rebuilt file {output}")
        os.close(fd)
        fd = -1
        os.replace(tmp, output)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(output.parent)
    return fetcher.stats

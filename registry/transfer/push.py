"""Push: cut a KV file into chunks, store the missing blobs, then commit to the catalog.

Blobs go first and the catalog commit is one transaction at the end, so a push that dies
half-way leaves only unreferenced blobs (gc sweeps them), never a row pointing at nothing.
Chunks are gathered, hashed and encoded on worker threads (hashlib and zstd release the
GIL); at most `window` chunks are in flight. A version 2 manifest names the file by the tree
of those digests, so each byte is hashed once; writing a version 1 manifest (to repair an
artifact pushed as one) also hashes the whole file and each tensor on a further worker.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvgraft.blobstore.base import BlobStore
from kvgraft.catalog.records import BlobRecord
from kvgraft.codecs.codec import (
    DEFAULT_CODEC,
    Selector,
    codec_selector,
    decode_blob,
    frame,
    max_stored_size,
    parse_frame,
)
from kvgraft.digest import Buffer, Digest
from kvgraft.errors import IntegrityError, InvalidKVFile, NotFound, UsageError
from kvgraft.formats.chunks import (
    DEFAULT_CHUNK_TOKENS,
    MAX_CHUNK_TOKENS,
    ChunkPlan,
    gather,
    plan_chunks,
)
from kvgraft.formats.kvfile import KVLayout, hash_file, read_layout
from kvgraft.formats.manifest import (
    CURRENT,
    VERSIONS,
    BlobRef,
    ChunkRef,
    LayerRef,
    Manifest,
    file_tree,
)
from kvgraft.formats.prefix import prefix_keys

Progress = Callable[[int], None]
_AGAIN = "push it again once nothing is writing to it"
UPLOADS_AHEAD = 4  # encoded chunks being sent while the workers encode the next ones


@dataclass(frozen=True, slots=True)
class PushOptions:
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    codec: str = DEFAULT_CODEC
    level: int | None = None
    parents: tuple[Digest, ...] = ()
    workers: int = 2
    window: int = 4
    version: int = CURRENT  # of the manifest

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_tokens <= MAX_CHUNK_TOKENS:
            raise UsageError(f"chunk tokens must be between 1 and {MAX_CHUNK_TOKENS}")
        if self.version not in VERSIONS:
            raise UsageError(f"manifest version must be one of {VERSIONS}")
        if self.workers < 1 or self.window < 1:
            raise UsageError("workers and window must be positive")


@dataclass(frozen=True, slots=True)
class Upload:
    """What building an artifact stored: the manifest and every blob's record."""

    manifest: Manifest
    blobs: tuple[BlobRecord, ...]
    stored: int = 0  # blobs this push wrote (the rest were already there)
    stored_bytes: int = 0
    repaired: tuple[BlobRecord, ...] = ()  # corrupt stored blobs replaced (rows to refresh)


def existing_record(store: BlobStore, digest: Digest, size: int) -> BlobRecord | None:
    """Describe a blob already in `store` (its codec comes from the stored frame)."""
    info = store.stat(digest)
    if info is None:
        return None
    with store.open(digest) as f:
        head = f.read(272)  # the longest possible frame header
    name, _, _ = parse_frame(head)
    return BlobRecord(digest, size, info.stored_size, name)


def checked_record(store: BlobStore, digest: Digest, size: int) -> BlobRecord | None:
    """Read a stored blob back: its record if it decodes to `size` bytes hashing to
    `digest`, None if it is corrupt (NotFound if it is gone)."""
    try:
        stored = store.get(digest, max_stored_size(size))
        name, _, _ = parse_frame(stored)
        _, data = decode_blob(stored, size)
    except IntegrityError:
        return None
    return BlobRecord(digest, size, len(stored), name) if Digest.of(data) == digest else None


class _Uploader:
    """Stores blobs; one already present is read back and checked, and replaced with the
    bytes in hand when it is corrupt, so pushing a file again repairs its blobs."""

    def __init__(self, store: BlobStore, select: Selector) -> None:
        self.store = store
        self.select = select  # the codec for each blob: the catalog row names the one used
        self.repaired: list[BlobRecord] = []
        # A graft's chunks are prefix-closed: each one's KV depends on every token before
        # it, so once one chunk is new to the store the later ones are too. Looking for
        # each of them would only cost a request (a round trip on an encoding thread) per
        # chunk; one that is there after all is refused by the store's create-only put and
        # then read back and checked, as any present blob is.
        self.looking = True

    def prepare(self, digest: Digest, data: Buffer) -> Callable[[], tuple[BlobRecord, bool]]:
        """The CPU half of `put`: look for the blob (until one is missing) and encode it if
        missing; returns the network half, to run on another thread (it may still refer to
        `data`)."""
        if self.looking:
            if self.store.exists(digest):
                return lambda: self.put(digest, data)
            self.looking = False
        size = memoryview(data).nbytes
        codec = self.select(data)
        parts = frame(codec, data)
        stored = sum(memoryview(p).nbytes for p in parts)

        def upload() -> tuple[BlobRecord, bool]:
            if self.store.put(digest, parts):
                return BlobRecord(digest, size, stored, codec.name), True
            return self.put(digest, data)  # a racing writer won: describe theirs

        return upload

    def put(self, digest: Digest, data: Buffer) -> tuple[BlobRecord, bool]:
        """Store `data` under `digest` unless present; returns its record and whether stored."""
        size = memoryview(data).nbytes
        # A gc may delete a blob between our look and our read: then store it ourselves
        # (registry.gc explains the rest of that race).
        for _ in range(3):
            if not self.store.exists(digest):
                codec = self.select(data)
                parts = frame(codec, data)
                stored = sum(memoryview(p).nbytes for p in parts)
                if self.store.put(digest, parts):
                    return BlobRecord(digest, size, stored, codec.name), True
            # Already there (or a racing writer won): describe what is actually stored,
            # having read it back.
            try:
                record = checked_record(self.store, digest, size)
            except NotFound:
                continue
            if record is not None:
                return record, False
            return self._repair(digest, data), True
        raise IntegrityError(f"blob {digest} kept vanishing from {self.store.url} during the "
                             "push", hint="push again")

    def _repair(self, digest: Digest, data: Buffer) -> BlobRecord:
        codec = self.select(data)
        parts = frame(codec, data)
        self.store.replace(digest, parts)
        record = BlobRecord(digest, memoryview(data).nbytes,
                            sum(memoryview(p).nbytes for p in parts), codec.name)
        self.repaired.append(record)
        return record


def build_artifact(path: str | Path, store: BlobStore, options: PushOptions,
                   progress: Progress | None = None) -> Upload:
    try:
        before: tuple[int, int, int, int] | None = _stamp(path)
    except OSError:
        before = None  # read_layout says what is wrong with the path
    layout = read_layout(path)
    plans = plan_chunks(layout, options.chunk_tokens)
    uploader = _Uploader(store, codec_selector(options.codec, options.level))
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            header = os.pread(fd, layout.header_size, 0)
            tokens = os.pread(fd, layout.token_ids.nbytes, layout.token_ids.begin)
            keys = prefix_keys(layout.identity, tokens, options.chunk_tokens)
            with ThreadPoolExecutor(options.workers + 1,
                                    thread_name_prefix="kvgraft-push") as pool:
                hashed = pool.submit(hash_file, fd, layout) if options.version == 1 else None
                records, chunk_refs = _upload_chunks(fd, plans, keys, uploader, pool, options,
                                                     progress)
                extra = [uploader.put(Digest.of(b), b) for b in (header, tokens)]
                if hashed is not None:
                    file_digest, tensor_digests = hashed.result()
                else:
                    file_digest = file_tree(layout.file_size, options.chunk_tokens,
                                            extra[0][0].digest, extra[1][0].digest,
                                            [c.digest for c in chunk_refs])
                    tensor_digests = {}
        except InvalidKVFile as e:  # a short read: the file shrank after its header was read
            raise InvalidKVFile(f"{path} changed while it was being pushed ({e.message})",
                                hint=_AGAIN) from None
        # The header, the token ids and the chunks (and in version 1 the file digest) come
        # from several reads of the file: if it was written in between they could disagree,
        # and pull would give back a file other than the one that was pushed.
        if _stamp(fd) != before:
            raise InvalidKVFile(f"{path} changed while it was being pushed", hint=_AGAIN)
    finally:
        os.close(fd)
    records += extra
    manifest = _manifest(layout, options, chunk_refs, tensor_digests, file_digest,
                         BlobRef(extra[0][0].digest, len(header)),
                         BlobRef(extra[1][0].digest, len(tokens)))
    unique = {r.digest: r for r, _ in records}
    new = [r for r, stored in records if stored]
    return Upload(manifest, tuple(unique.values()), len(new), sum(r.stored_size for r in new),
                  tuple(uploader.repaired))


def _stamp(file: str | Path | int) -> tuple[int, int, int, int]:
    st = os.stat(file)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _upload_chunks(fd: int, plans: Sequence[ChunkPlan], keys: Sequence[Digest],
                   uploader: _Uploader, pool: ThreadPoolExecutor, options: PushOptions,
                   progress: Progress | None,
                   ) -> tuple[list[tuple[BlobRecord, bool]], list[ChunkRef]]:
    buffers: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
    for _ in range(options.window + UPLOADS_AHEAD):
        buffers.put(bytearray())  # reused: fresh large buffers cost page faults

    def work(plan: ChunkPlan) -> Future[tuple[BlobRecord, bool]]:
        buf = buffers.get()
        try:
            payload = gather(fd, plan, buf)
            upload = uploader.prepare(Digest.of(payload), payload)
        except BaseException:
            buffers.put(buf)
            raise

        def send() -> tuple[BlobRecord, bool]:
            try:
                return upload()
            finally:
                buffers.put(buf)  # the encoded parts may be views of it until now

        return uploads.submit(send)

    records: list[tuple[BlobRecord, bool]] = []
    refs: list[ChunkRef] = []
    pending: list[tuple[ChunkPlan, Future[Future[tuple[BlobRecord, bool]]]]] = []

    def drain(keep: int) -> None:
        while len(pending) > keep:
            plan, fut = pending.pop(0)
            rec, stored = fut.result().result()
            records.append((rec, stored))
            refs.append(ChunkRef(plan.index, plan.start, plan.end, rec.digest, rec.size,
                                 keys[plan.index]))
            if progress:
                progress(plan.size)

    # The uploads run on threads of their own: a PUT mostly waits on the network, and while
    # the encoding workers also did the sending the link idled whenever they all encoded.
    with ThreadPoolExecutor(UPLOADS_AHEAD, thread_name_prefix="kvgraft-upload") as uploads:
        for plan in plans:
            drain(options.window + UPLOADS_AHEAD - 1)
            pending.append((plan, pool.submit(work, plan)))
        drain(0)
    return records, refs


def _manifest(layout: KVLayout, options: PushOptions, chunks: list[ChunkRef],
              tensors: dict[str, Digest], file_digest: Digest, header: BlobRef,
              tokens: BlobRef) -> Manifest:
    layers = tuple(LayerRef(lr.index, lr.start, lr.length, lr.key.dtype, lr.key.shape[0],
                            lr.key.shape[2], lr.value.shape[2]) for lr in layout.layers)
    manifest = Manifest(
        model=layout.identity, model_name=layout.model_name,
        model_config=dict(layout.model_config), token_count=layout.token_count,
        tokens=tokens, chunk_tokens=options.chunk_tokens, chunks=tuple(chunks), layers=layers,
        tensors=tensors, file_digest=file_digest, file_size=layout.file_size, header=header,
        parents=options.parents, provenance=dict(layout.provenance), version=options.version)
    # Validate what we are about to commit exactly as a reader will.
    return Manifest.from_json(manifest.to_json())

"""Blob bytes as OCI clients see them. Graft blobs are stored encoded (keyed by their
decoded digest): their frame is checked before a byte is sent. Blobs OCI clients push are
stored in the same store in the raw frame. Either is hashed on the way (a graft blob's
range read excepted, see _stream_decoded) and its last piece held back until the hash
matched: a stored blob that does not hash to its name aborts the response short of its
Content-Length, never a clean end. A body of at most VERIFY_FIRST bytes is read whole and
checked before the status line is sent (the caller joins `Body.pieces`)."""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from starlette.responses import StreamingResponse
from starlette.types import Send

from kvgraft.blobstore import BlobStore
from kvgraft.blobstore.base import Presigning
from kvgraft.codecs.codec import MAGIC, frame, get_codec, max_stored_size
from kvgraft.codecs.stream import decoded_pieces, seekable
from kvgraft.digest import Buffer, Digest
from kvgraft.errors import IntegrityError, NotFound
from kvgraft.oci.graft import EMPTY_DIGEST, EMPTY_JSON

_log = logging.getLogger("kvgraft.server")
PIECE = 1 << 20
VERIFY_FIRST = 4 * PIECE  # bodies this small are checked whole before the status line
_SIZE = struct.Struct("<Q")


def file_digest(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while piece := f.read(PIECE):
            h.update(piece)
            size += len(piece)
    return "sha256:" + h.hexdigest(), size


def store_file(store: BlobStore, digest: Digest, path: Path) -> None:
    """Put the (already verified) file at `path` into the store as a raw-framed blob."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            store.put(digest, frame(get_codec("raw"), b""))
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                store.put(digest, frame(get_codec("raw"), view))
            finally:
                view.release()


@dataclass(frozen=True, slots=True)
class Body:
    """What to send for a blob: an iterator of pieces, `length` bytes in all."""

    pieces: Iterator[bytes]
    length: int


def _read_header(f: BinaryIO) -> tuple[str, int]:
    head = f.read(6)
    if len(head) < 6 or head[:4] != MAGIC:
        raise IntegrityError("stored blob does not start with the kvgraft blob header")
    name = f.read(head[5]).decode("ascii", "replace")
    raw = f.read(_SIZE.size)
    if len(raw) != _SIZE.size:
        raise IntegrityError("stored blob header is truncated")
    return name, _SIZE.unpack(raw)[0]


def open_blob(store: BlobStore, digest: str, size: int, start: int = 0,
              end: int | None = None) -> Body:
    """Bytes [start, end) of blob `digest` (decoded size `size`); NotFound if absent."""
    d = Digest.parse(digest)
    end = size if end is None else end
    if digest == EMPTY_DIGEST:
        return Body(iter([EMPTY_JSON[start:end]]), end - start)
    f = store.open(d)
    try:
        name, declared = _read_header(f)
        if declared != size:
            raise IntegrityError(f"stored blob {digest} declares {declared} bytes, "
                                 f"expected {size}")
        if name != "raw":
            f.close()  # read from the start again, and at will (a store stream is spooled)
            f = seekable(store.open(d), max_stored_size(size))
            pieces = decoded_pieces(f, size)  # checks the frame before a byte goes
            return Body(_stream_decoded(f, pieces, d, size, start, end), end - start)
    except BaseException:
        f.close()
        raise
    return Body(_stream_raw(f, d, size, start, end), end - start)


def _stream_raw(f: BinaryIO, digest: Digest, size: int, start: int, end: int,
                ) -> Iterator[bytes]:
    # The whole blob is hashed even for a range, so a corrupt one is never served whole.
    h = hashlib.sha256()
    pos = 0
    held: bytes | None = None  # the last piece goes only once the hash matched
    with f:
        while pos < size:
            piece = f.read(min(PIECE, size - pos))
            if not piece:
                raise IntegrityError(f"stored blob {digest} is truncated")
            h.update(piece)
            lo, hi = max(start - pos, 0), min(end - pos, len(piece))
            if lo < hi:
                if held is not None:
                    yield held
                held = piece[lo:hi]
            pos += len(piece)
        if f.read(1):
            raise IntegrityError(f"stored blob {digest} is longer than it should be")
    digest.check(Digest.from_hasher(h), f"stored blob {digest}")
    if held is not None:
        yield held


def _stream_decoded(f: BinaryIO, pieces: Iterator[Buffer], digest: Digest, size: int,
                    start: int, end: int) -> Iterator[bytes]:
    # Decoded as sent, never whole. A whole blob is hashed and aborts on a mismatch like a
    # raw one; a range is decoded only as far as its end and is not hashed: the hash needs
    # every byte, and by the time it could fail the client would have its range anyway.
    whole = start == 0 and end == size
    h = hashlib.sha256()
    pos = 0
    held: bytes | None = None  # a whole read's last piece goes once the hash matched
    with f:
        for piece in pieces:
            if whole:
                h.update(piece)
            n = memoryview(piece).nbytes
            lo, hi = max(start - pos, 0), min(end - pos, n)
            if lo < hi:
                out = piece if (lo, hi) == (0, n) and isinstance(piece, bytes) else \
                    bytes(memoryview(piece)[lo:hi])
                if not whole:
                    yield out
                else:
                    if held is not None:
                        yield held
                    held = out
            pos += n
            if pos >= end and not whole:
                return
    if whole:
        digest.check(Digest.from_hasher(h), f"stored blob {digest}")
        if held is not None:
            yield held


class CheckedStream(StreamingResponse):
    """A blob body whose pieces may fail their check mid-way (IntegrityError): the
    response is then left short of its Content-Length and the connection closed by the
    server, so no client mistakes it for a whole blob. Logged as one warning, not as an
    application error: the store, not the request, is at fault."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                data = chunk if isinstance(chunk, bytes | memoryview) else \
                    chunk.encode(self.charset)
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except IntegrityError as e:
            _log.warning("response aborted: %s", e.message)
            return  # never the final, empty body message: the server closes the connection
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def presigned(store: BlobStore, digest: Digest, seconds: int) -> str | None:
    """Where a client may fetch the stored bytes of `digest` itself, or None when the store
    cannot say (a local store: the server then sends the bytes)."""
    if not isinstance(store, Presigning):
        return None
    return store.presign(digest, seconds)


def require(store: BlobStore, digest: str) -> None:
    if digest != EMPTY_DIGEST and not store.exists(Digest.parse(digest)):
        raise NotFound(f"blob {digest} is not in the store")

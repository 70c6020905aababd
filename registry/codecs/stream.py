"""Decode a stored blob piece by piece, from a file, in bounded memory.

`decode_blob` fills one buffer of the whole decoded size: right for pulls, which need the
bytes anyway, wrong for a server that only has to check what a client sent (or serve part of
it) and must not let a client decide how much it allocates. Here the frame header's size is
checked against the expected size before anything is decoded, each codec's layout is
checked against the stored length before its body is, and the decoded bytes come out in
pieces of at most `piece` bytes: memory is a few pieces (plus, for zstd, the frame's window:
at most min(its window, its size), and the window is capped at zstdframe.MAX_WINDOW).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from kvgraft.codecs import bytegroup, planelayout
from kvgraft.codecs.codec import FRAME_VERSION, MAGIC, decode_blob, max_stored_size
from kvgraft.codecs.zstdframe import FrameReader, ReadAt
from kvgraft.digest import Buffer
from kvgraft.errors import IntegrityError

PIECE = 1 << 20
_SIZE = struct.Struct("<Q")


def reader_at(f: BinaryIO) -> ReadAt:
    """Positioned reads of a seekable file (one thread at a time)."""

    def read_at(offset: int, n: int) -> bytes:
        f.seek(offset)
        return f.read(n)

    return read_at


def stored_header(read_at: ReadAt) -> tuple[str, int, int]:
    """(codec name, declared decoded size, header length) of a stored blob."""
    head = read_at(0, 6)
    if len(head) < 6 or head[:4] != MAGIC:
        raise IntegrityError("stored blob does not start with the kvgraft blob header")
    if head[4] != FRAME_VERSION:
        raise IntegrityError(f"stored blob has unknown frame version {head[4]}")
    end = 6 + head[5] + _SIZE.size
    rest = read_at(6, end - 6)
    if len(rest) != end - 6:
        raise IntegrityError("stored blob header is truncated")
    try:
        name = rest[: head[5]].decode("ascii")
    except UnicodeDecodeError:
        raise IntegrityError("stored blob names a codec that is not ASCII") from None
    return name, _SIZE.unpack(rest[head[5] :])[0], end


def decoded_pieces(f: BinaryIO, size: int, *, piece: int = PIECE) -> Iterator[Buffer]:
    """The decoded bytes of the stored blob in the seekable file `f`, which must decode to
    exactly `size` bytes (IntegrityError otherwise, before any decoding where the header or
    layout already says so). The caller hashes the pieces against the blob's digest."""
    read_at = reader_at(f)
    stored = f.seek(0, 2)
    if stored > max_stored_size(size):
        raise IntegrityError(f"stored blob takes {stored} bytes, more than a blob of {size} "
                             "bytes can")
    name, declared, start = stored_header(read_at)
    if declared != size:
        raise IntegrityError(f"stored blob declares {declared} decoded bytes, expected {size}")
    length = stored - start

    def body_at(offset: int, n: int) -> bytes:
        return read_at(start + offset, n)

    if name == "raw":
        if length != size:
            raise IntegrityError(f"raw blob holds {length} bytes, expected {size}")
        return _raw(body_at, 0, size, piece)
    if name == "zstd":
        return _frame(FrameReader(body_at, 0, length, size), piece)
    if name == bytegroup.NAME:
        return _bytegroup(planelayout.parse_layout(body_at, length, size), body_at, piece)
    # A codec registered from outside knows only whole-blob decoding; the size is bounded
    # by the caller's limit all the same.
    return iter([decode_blob(read_at(0, stored), size)[1]])


def _raw(read_at: ReadAt, offset: int, n: int, piece: int) -> Iterator[bytes]:
    end = offset + n
    while offset < end:
        data = read_at(offset, min(piece, end - offset))
        if not data:
            raise IntegrityError("stored blob is truncated")
        offset += len(data)
        yield data


def _frame(reader: FrameReader, piece: int) -> Iterator[bytes]:
    while reader.left:
        yield reader.read(piece)
    reader.finish()


class _Plane:
    """One byte plane of a segment, read `n` bytes at a time however it is stored."""

    def __init__(self, read_at: ReadAt, method: int, offset: int, stored: int, n: int) -> None:
        self.frame = (FrameReader(read_at, offset, stored, n, what="plane")
                      if method == planelayout.ZSTD else None)
        self.read_at, self.offset = read_at, offset

    def read(self, n: int) -> bytes:
        if self.frame is not None:
            return self.frame.read(n)
        data = self.read_at(self.offset, n)
        if len(data) != n:
            raise IntegrityError("bytegroup plane is truncated")
        self.offset += n
        return data

    def finish(self) -> None:
        if self.frame is not None:
            self.frame.finish()


def _bytegroup(layout: planelayout.Layout, read_at: ReadAt, piece: int) -> Iterator[Buffer]:
    scratch = bytegroup._Scratch()
    for width, rotated, length, placed in layout:
        planes = [_Plane(read_at, m, at, stored, length // width) for m, at, stored in placed]
        step = max(piece // width, 1)
        for done in range(0, length // width, step):
            k = min(step, length // width - done)
            parts = [np.frombuffer(p.read(k), np.uint8) for p in planes]
            if width == 1:
                yield parts[0].data
                continue
            out = np.empty(k * width, np.uint8)
            bytegroup.merge_planes(parts, width, rotated, out.data, scratch)
            yield out.data
        for p in planes:
            p.finish()


def seekable(f: BinaryIO, limit: int) -> BinaryIO:
    """`f` itself if it can seek, else its bytes (at most `limit`) spooled to a temporary
    file: a store's network stream is read once, to disk, not into memory."""
    if f.seekable():
        return f
    import tempfile

    spool = tempfile.TemporaryFile()  # noqa: SIM115 (handed to the caller, who closes it)
    try:
        copied = 0
        while data := f.read(PIECE):
            copied += len(data)
            if copied > limit:
                raise IntegrityError(f"stored blob is longer than the {limit} bytes it may take")
            spool.write(data)
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    finally:
        f.close()
    return spool

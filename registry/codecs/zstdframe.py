"""Decode one zstd frame to exactly the size the caller expects (both codecs use it).

The declared content size is checked before anything is allocated, and the output is capped
at that size, so a frame that lies about its size fails instead of allocating what it claims.
"""

from __future__ import annotations

from collections.abc import Callable

import zstandard

from kvgraft.digest import Buffer
from kvgraft.errors import IntegrityError


def decode_frame(body: Buffer, size: int, *, what: str = "frame",
                 dctx: zstandard.ZstdDecompressor | None = None) -> bytes:
    """Exactly one frame holding exactly `size` bytes; IntegrityError names `what` otherwise."""
    dctx = dctx or zstandard.ZstdDecompressor()
    try:
        declared = zstandard.get_frame_parameters(body).content_size
    except zstandard.ZstdError as e:
        raise IntegrityError(f"corrupt zstd {what}: {e}") from None
    if declared != size:
        raise IntegrityError(f"zstd {what} declares {declared} bytes, expected {size}")
    try:
        if size == 0:
            # One-shot decompression of a frame that declares no content returns b"" without
            # reading it; a streaming decoder has to reach the end of the frame.
            obj = dctx.decompressobj()
            out: bytes = obj.decompress(body)
            if not obj.eof or obj.unused_data:
                raise IntegrityError(f"zstd {what} is truncated or has trailing data")
            return out
        out = dctx.decompress(body, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"corrupt zstd {what}: {e}") from None
    if len(out) != size:
        raise IntegrityError(f"zstd {what} decoded to {len(out)} bytes, expected {size}")
    return out


# --- decoding a frame as it is read ------------------------------------------------------

ReadAt = Callable[[int, int], bytes]  # (offset, n) -> up to n bytes at offset of a source
# The largest window a streamed frame may ask for: zstd's own default limit (what levels up
# to 22 write). A window costs decoder memory up to min(window, content size).
MAX_WINDOW = 1 << 27
_HEADER_MAX = 18  # magic + the longest frame header


def frame_length(read_at: ReadAt, offset: int, limit: int, head: bytes, what: str) -> int:
    """The length of the zstd frame at `offset` by walking its block headers (no decoding):
    a frame is exactly as long as its blocks say, so trailing data or a cut shows here."""
    try:
        pos = zstandard.frame_header_size(head)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"corrupt zstd {what}: {e}") from None
    while True:
        b = read_at(offset + pos, 3)
        if len(b) < 3:
            raise IntegrityError(f"zstd {what} is truncated")
        v = int.from_bytes(b, "little")
        kind, block = (v >> 1) & 3, v >> 3
        if kind == 3:
            raise IntegrityError(f"corrupt zstd {what}: reserved block type")
        pos += 3 + (1 if kind == 1 else block)
        if pos > limit:
            raise IntegrityError(f"zstd {what} is truncated")
        if v & 1:
            return pos + (4 if head[4] & 0x04 else 0)


class _Window:
    """A file-like view of [offset, offset + length) of a source, for zstd's stream reader."""

    def __init__(self, read_at: ReadAt, offset: int, length: int) -> None:
        self._read_at, self._pos, self._end = read_at, offset, offset + length

    def read(self, n: int = -1) -> bytes:
        n = self._end - self._pos if n < 0 else min(n, self._end - self._pos)
        data = self._read_at(self._pos, n) if n > 0 else b""
        self._pos += len(data)
        return data


class FrameReader:
    """Exactly one zstd frame holding exactly `size` bytes, at [offset, offset + length) of a
    source, decoded as it is read: the declared size and the frame's extent are checked
    before anything is decoded, and no read returns more than asked for."""

    def __init__(self, read_at: ReadAt, offset: int, length: int, size: int, *,
                 what: str = "frame") -> None:
        self.what = what
        head = read_at(offset, min(length, _HEADER_MAX))
        try:
            declared = zstandard.get_frame_parameters(head).content_size
        except zstandard.ZstdError as e:
            raise IntegrityError(f"corrupt zstd {what}: {e}") from None
        if declared != size:
            raise IntegrityError(f"zstd {what} declares {declared} bytes, expected {size}")
        if frame_length(read_at, offset, length, head, what) != length:
            raise IntegrityError(f"zstd {what} is truncated or has trailing data")
        dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        self._reader = dctx.stream_reader(_Window(read_at, offset, length),  # type: ignore[arg-type]
                                          read_size=1 << 17, closefd=False)
        self.left = size

    def read(self, n: int) -> bytes:
        """Exactly min(n, what is left) bytes."""
        n = min(n, self.left)
        parts, got = [], 0
        try:
            while got < n:
                piece = self._reader.read(n - got)
                if not piece:
                    raise IntegrityError(f"zstd {self.what} ended before its declared size")
                parts.append(piece)
                got += len(piece)
        except zstandard.ZstdError as e:
            raise IntegrityError(f"corrupt zstd {self.what}: {e}") from None
        self.left -= n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def finish(self) -> None:
        """Check the frame ends where its declared size does."""
        try:
            extra = self._reader.read(1)
        except zstandard.ZstdError as e:
            raise IntegrityError(f"corrupt zstd {self.what}: {e}") from None
        if self.left or extra:
            raise IntegrityError(f"zstd {self.what} does not hold its declared size")

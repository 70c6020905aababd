"""File-like views the S3 store hands to botocore and reads from it: a sequence of buffers
read as one body without joining them, and a response body whose failures become typed."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import botocore.exceptions

from kvgraft.digest import Buffer
from kvgraft.errors import Unavailable


class PartsReader(io.RawIOBase):
    """A seekable reader over a sequence of buffers, so an upload streams them without
    joining them into one copy (botocore rewinds it to retry or to checksum)."""

    def __init__(self, parts: Sequence[Buffer]) -> None:
        self._parts = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
        self._size = sum(p.nbytes for p in self._parts)
        self._pos = 0
        self._index = 0  # the part holding _pos
        self._offset = 0  # _pos within that part

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(base + offset, 0), self._size)
        self._index, self._offset, rest = 0, 0, self._pos
        while self._index < len(self._parts) and rest >= self._parts[self._index].nbytes:
            rest -= self._parts[self._index].nbytes
            self._index += 1
        self._offset = rest
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < out.nbytes and self._index < len(self._parts):
            part = self._parts[self._index]
            n = min(out.nbytes - done, part.nbytes - self._offset)
            out[done:done + n] = part[self._offset:self._offset + n]
            done += n
            self._offset += n
            if self._offset == part.nbytes:
                self._index, self._offset = self._index + 1, 0
        self._pos += done
        return done


def slices(parts: Sequence[Buffer], start: int, end: int) -> list[memoryview]:
    """Views of bytes [start, end) of the concatenation of `parts` (no copy)."""
    out: list[memoryview] = []
    pos = 0
    for p in parts:
        view = memoryview(p).cast("B")
        lo, hi = max(start - pos, 0), min(end - pos, view.nbytes)
        if lo < hi:
            out.append(view[lo:hi])
        pos += view.nbytes
    return out


class BodyReader(io.RawIOBase):
    """A raw reader over a botocore streaming body, so callers get a real BinaryIO."""

    def __init__(self, body: Any, fail: Callable[[Exception], NoReturn]) -> None:
        self._body = body
        self._fail = fail

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        try:
            data = self._body.read(out.nbytes)
        except (botocore.exceptions.BotoCoreError, OSError) as e:
            self._fail(e)
        out[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


def read_exactly(reader: io.RawIOBase, out: memoryview, what: str) -> None:
    done = 0
    while done < out.nbytes:
        n = reader.readinto(out[done:])
        if not n:
            raise Unavailable(f"{what}: the server sent {done} of {out.nbytes} bytes",
                              hint="retry; the connection was cut")
        done += n

"""Blob codecs and the self-describing stored-blob frame (docs/format.md §7).

A stored blob is `KVGB | version | len(name) | name | decoded size (u64 LE) | body`, so any
blob can be decoded without the catalog. Codecs are added by name and never changed: a new
encoding is a new name. Decoding is bounded by the size the caller expects (a decompression
bomb is refused before it allocates) and the caller hashes the result against its key.
"""

from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Callable
from typing import Protocol

import zstandard

from kvgraft.codecs import bytegroup
from kvgraft.codecs.zstdframe import decode_frame
from kvgraft.digest import Buffer
from kvgraft.errors import IntegrityError, UnknownCodec, UsageError

MAGIC = b"KVGB"
FRAME_VERSION = 1
_SIZE = struct.Struct("<Q")


class Codec(Protocol):
    """Turns decoded bytes into a stored body and back. Must be thread-safe."""

    @property
    def name(self) -> str: ...

    def encode(self, data: Buffer) -> Buffer: ...

    def decode(self, body: memoryview, size: int) -> Buffer:
        """Return exactly `size` bytes, or raise IntegrityError."""
        ...

    def decode_into(self, body: memoryview, out: memoryview) -> None:
        """Fill `out` (its length is the decoded size) exactly, or raise IntegrityError."""
        ...


class RawCodec:
    name = "raw"

    def encode(self, data: Buffer) -> Buffer:
        return data

    def decode(self, body: memoryview, size: int) -> Buffer:
        if body.nbytes != size:
            raise IntegrityError(f"raw blob holds {body.nbytes} bytes, expected {size}")
        return body

    def decode_into(self, body: memoryview, out: memoryview) -> None:
        out[:] = self.decode(body, out.nbytes)


class ZstdCodec:
    """One zstd frame with its content size; compressors are per thread (not thread-safe)."""

    name = "zstd"

    def __init__(self, level: int = 1) -> None:
        if not -7 <= level <= 22:
            raise UsageError(f"zstd level must be between -7 and 22, got {level}")
        self.level = level
        self._local = threading.local()

    def _cctx(self) -> zstandard.ZstdCompressor:
        cctx: zstandard.ZstdCompressor | None = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = zstandard.ZstdCompressor(level=self.level)
        return cctx

    def encode(self, data: Buffer) -> Buffer:
        return self._cctx().compress(data)

    def decode(self, body: memoryview, size: int) -> Buffer:
        return decode_frame(body, size)

    def decode_into(self, body: memoryview, out: memoryview) -> None:
        # Payloads without float tensors (the only ones stored as plain zstd) are small.
        out[:] = decode_frame(body, out.nbytes)


CodecFactory = Callable[[int | None], Codec]
_CODECS: dict[str, CodecFactory] = {
    "raw": lambda level: RawCodec(),
    "zstd": lambda level: ZstdCodec(1 if level is None else level),
    bytegroup.NAME: lambda level: bytegroup.ByteGroupCodec(level),
}
# Not a codec: a push-time policy that picks one per blob, so it never names a stored blob.
AUTO = "auto"
DEFAULT_CODEC = AUTO
# Payload dtypes for which byte planes beat plain zstd (benchmarks/codec.py measures this).
BYTEGROUP_DTYPES = frozenset({"BF16", "F16", "F32"})
Selector = Callable[[Buffer], Codec]


def register(name: str, factory: CodecFactory) -> None:
    if name in _CODECS:
        raise ValueError(f"codec {name!r} is already registered; codecs never change")
    _CODECS[name] = factory


def codec_names() -> list[str]:
    return sorted(_CODECS)


def push_codec_names() -> list[str]:
    """What `push --codec` accepts: every codec plus the per-blob policy `auto`."""
    return [AUTO, *codec_names()]


def best_codec_name(data: Buffer) -> str:
    """The codec that stores this payload best: byte planes for float tensors, else zstd."""
    return bytegroup.NAME if bytegroup.payload_dtypes(data) & BYTEGROUP_DTYPES else "zstd"


def codec_selector(name: str, level: int | None = None) -> Selector:
    """The codec to encode each blob with: fixed for a codec name, per blob for `auto`."""
    if name != AUTO:
        codec = get_codec(name, level)
        return lambda data: codec
    codecs = {n: get_codec(n, level) for n in (bytegroup.NAME, "zstd")}
    return lambda data: codecs[best_codec_name(data)]


def get_codec(name: str, level: int | None = None) -> Codec:
    factory = _CODECS.get(name)
    if factory is None:
        raise UnknownCodec(f"unknown codec {name!r}", hint=f"known: {', '.join(codec_names())}")
    return factory(level)


def frame_header(codec_name: str, size: int) -> bytes:
    """The header of a stored blob of `size` decoded bytes in codec `codec_name`."""
    name = codec_name.encode("ascii")
    return MAGIC + bytes([FRAME_VERSION, len(name)]) + name + _SIZE.pack(size)


def frame(codec: Codec, data: Buffer) -> list[Buffer]:
    """Encode `data` and return the stored blob as parts (header, body): no extra copy."""
    return [frame_header(codec.name, memoryview(data).nbytes), codec.encode(data)]


def max_stored_size(size: int) -> int:
    """The most bytes a stored blob of `size` decoded bytes can take: the longest frame
    header, plus zstd's worst-case expansion (ZSTD_COMPRESSBOUND) with room to spare. A
    reader refuses anything longer before reading it."""
    return 6 + 255 + _SIZE.size + size + (size >> 7) + 4096


def parse_frame(stored: Buffer) -> tuple[str, int, memoryview]:
    """Return (codec name, decoded size, body) of a stored blob."""
    view = memoryview(stored)
    if view.nbytes < 6 or bytes(view[:4]) != MAGIC:
        raise IntegrityError("stored blob does not start with the kvgraft blob header")
    if view[4] != FRAME_VERSION:
        raise IntegrityError(f"stored blob has unknown frame version {view[4]}")
    n = view[5]
    end = 6 + n + _SIZE.size
    if view.nbytes < end:
        raise IntegrityError("stored blob header is truncated")
    try:
        name = bytes(view[6 : 6 + n]).decode("ascii")
    except UnicodeDecodeError:
        raise IntegrityError("stored blob names a codec that is not ASCII") from None
    (size,) = _SIZE.unpack(view[6 + n : end])
    return name, size, view[end:]


@functools.cache
def _decoder(name: str) -> Codec:
    # One instance per codec for every decode: its per-thread contexts and scratch buffers
    # are then reused from blob to blob (fresh ones cost page faults on every chunk).
    return get_codec(name)


def decode_blob(stored: Buffer, expected_size: int, into: Buffer | None = None
                ) -> tuple[str, Buffer]:
    """Decode a stored blob to exactly `expected_size` bytes; returns (codec name, bytes).

    With `into` (at least `expected_size` bytes, reused by the caller) the bytes are decoded
    there and the result is a view of it."""
    name, size, body = parse_frame(stored)
    codec = _decoder(name)
    if size != expected_size:
        raise IntegrityError(
            f"stored blob declares {size} decoded bytes, expected {expected_size}"
        )
    if into is not None:
        view = memoryview(into).cast("B")[:size]
        if view.nbytes != size:
            raise ValueError(f"decode buffer holds {view.nbytes} bytes, {size} needed")
        codec.decode_into(body, view)
        return name, view
    out = codec.decode(body, size)
    if memoryview(out).nbytes != size:
        raise IntegrityError(f"codec {name} returned the wrong number of bytes")
    return name, out

"""The `zstd-bytegroup` codec: byte planes for float tensors, zstd where it pays.

A 16-bit float is an exponent byte with a few bits of entropy beside a mantissa byte that is
nearly noise; interleaved, zstd sees noise everywhere. So each float tensor's values are cut
into byte planes (plane j holds byte j of every value), the sign bit first rotated into the
lowest byte so that the top byte is the whole exponent. A plane whose sampled entropy says it
will not shrink is stored raw (the mantissa bytes), the others go through zstd with
parameters tuned for short-match, low-entropy data.

The payload is read as a safetensors payload only to find where each tensor's bytes lie and
its dtype; those are hints. The body says how to rebuild the bytes without them, so any
payload (not safetensors, odd sizes, empty) round-trips, and a wrong hint only costs ratio.

Body: `u8 version | u32 segment count | segments | plane data`; a segment is
`u8 width | u8 rotated | u64 length | width x (u8 method | u64 stored length)` and covers the
next `length` decoded bytes. Decoding checks every length against the declared size before it
allocates anything and never writes past it.

Speed: push and pull run this on every chunk on all cores, so both directions are a handful
of whole-array numpy operations and one zstd call per compressed plane, each of which drops
the GIL, and write into one output buffer (planes are built where the body stores them, zstd
writes into its place); nothing is joined or copied again afterwards.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from kvgraft.codecs.planelayout import (
    BODY_VERSION,
    HEAD,
    PLANE,
    RAW,
    SEGMENT,
    ZSTD,
    parse_layout,
)
from kvgraft.codecs.zstdframe import decode_frame
from kvgraft.digest import Buffer
from kvgraft.errors import IntegrityError, UsageError

NAME = "zstd-bytegroup"
# Plane width and whether to rotate the sign bit down, per safetensors dtype.
GROUPED: dict[str, tuple[int, bool]] = {
    "BF16": (2, True), "F16": (2, True), "F32": (4, True), "F64": (8, True),
}  # fmt: skip
# Above this order-0 entropy (bits per byte) a plane gains < 2.5% from any byte coder; storing
# it raw makes both directions a memcpy.
RAW_ENTROPY = 7.8
SAMPLE = 1 << 14
TRY_BELOW = 1 << 16
MAX_HINT_HEADER = 64 * 1024 * 1024


U8Array = npt.NDArray[np.uint8]


# Exponent planes have few matches of 7+ bytes and are mostly Huffman-coded literals. A tiny
# hash table finds what matches there are at a fraction of level 1's search cost, and a 16 KiB
# window means 16 KiB blocks, whose Huffman tables follow the data more closely than 128 KiB
# ones (measured on real BF16 KV: exponent plane 335.7 kB with window_log 14 vs 341.7 kB with
# 17, at the same speed).
WINDOW_LOG, HASH_LOG, MIN_MATCH = 14, 6, 7
# Where libzstd's parameters can be set directly: skip ahead this fast when no match is found,
# and Huffman-code the literals anyway (python-zstandard's public parameters turn literal
# compression off for any acceleration: ratio ~1.0). 1.3-1.6x faster on exponent planes, as
# small.
ACCELERATION = 1 << 16


def tuned_parameters() -> zstandard.ZstdCompressionParameters:
    """The same tuning through python-zstandard's public API (without the acceleration)."""
    return zstandard.ZstdCompressionParameters(
        strategy=zstandard.STRATEGY_FAST, min_match=MIN_MATCH, hash_log=HASH_LOG,
        window_log=WINDOW_LOG, write_content_size=1)


@dataclass(frozen=True, slots=True)
class Segment:
    offset: int
    length: int
    width: int
    rotated: bool


def hint_segments(data: Buffer) -> tuple[Segment, ...]:
    """Cut a payload into segments by the safetensors header it may carry; never raises."""
    view = memoryview(data).cast("B")
    size = view.nbytes
    n = _header_length(view)
    if n is None:
        return (Segment(0, size, 1, False),) if size else ()
    # Every full chunk of an artifact has the same header: parse each distinct one once.
    return _segments(bytes(view[8 : 8 + n]), size)


def _header_length(view: memoryview) -> int | None:
    if view.nbytes < 8:
        return None
    (n,) = struct.unpack_from("<Q", view, 0)
    return n if n <= MAX_HINT_HEADER and 8 + n <= view.nbytes else None


@functools.lru_cache(maxsize=32)
def _segments(header: bytes, size: int) -> tuple[Segment, ...]:
    tensors = _hinted_tensors(header, size)
    if tensors is None:
        return (Segment(0, size, 1, False),)
    out: list[Segment] = []
    pos = 0

    def add(offset: int, length: int, width: int, rotated: bool) -> None:
        if length == 0:
            return
        if out and (out[-1].width, out[-1].rotated) == (width, rotated):
            last = out.pop()
            out.append(Segment(last.offset, last.length + length, width, rotated))
        else:
            out.append(Segment(offset, length, width, rotated))

    for begin, end, dtype in tensors:
        add(pos, begin - pos, 1, False)  # the header, or a gap between tensors
        width, rotated = GROUPED.get(dtype, (1, False))
        if (end - begin) % width:
            width, rotated = 1, False
        add(begin, end - begin, width, rotated)
        pos = end
    add(pos, size - pos, 1, False)
    return tuple(out)


def payload_dtypes(data: Buffer) -> frozenset[str]:
    """Dtypes of the non-empty tensors of a safetensors payload (empty if it is not one)."""
    view = memoryview(data).cast("B")
    n = _header_length(view)
    if n is None:
        return frozenset()
    return _dtypes(bytes(view[8 : 8 + n]), view.nbytes)


@functools.lru_cache(maxsize=32)
def _dtypes(header: bytes, size: int) -> frozenset[str]:
    return frozenset(d for b, e, d in _hinted_tensors(header, size) or () if e > b)


def _hinted_tensors(raw: bytes, size: int) -> list[tuple[int, int, str]] | None:
    """(begin, end, dtype) of each tensor, sorted and non-overlapping, or None."""
    n = len(raw)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    base = 8 + n
    tensors = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(spec, dict):
            return None
        dtype, offsets = spec.get("dtype"), spec.get("data_offsets")
        if not (isinstance(dtype, str) and isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= size - base):
            return None
        tensors.append((base + offsets[0], base + offsets[1], dtype))
    tensors.sort()
    for (_, end, _), (begin, _, _) in itertools.pairwise(tensors):
        if begin < end:
            return None
    return tensors


def sampled_entropy(plane: U8Array) -> float:
    """Order-0 entropy in bits per byte of an evenly spaced sample of `plane`."""
    if plane.size == 0:
        return 0.0
    sample = plane[:: max(1, plane.size // SAMPLE)]
    counts = np.bincount(sample, minlength=256)
    p = counts[counts > 0] / sample.size
    return float(-(p * np.log2(p)).sum())


class _Scratch(threading.local):
    """Per-thread buffers reused across chunks: fresh large arrays cost page faults."""

    def __init__(self) -> None:
        self.arrays: dict[tuple[str, int], npt.NDArray[Any]] = {}

    def get(self, dtype: npt.DTypeLike, count: int, slot: int = 0) -> npt.NDArray[Any]:
        dt = np.dtype(dtype)
        key = (dt.str, slot)
        arr = self.arrays.get(key)
        if arr is None or arr.size < count:
            arr = self.arrays[key] = np.empty(max(count, 1), dt)
        return arr[:count]


# --- zstd into and out of caller buffers -------------------------------------------------


class _Zstd:
    """One thread's zstd contexts through python-zstandard's public API.

    Both directions return or take fresh `bytes`, so each plane costs one extra copy.
    """

    def __init__(self, level: int | None) -> None:
        self._cctx = (zstandard.ZstdCompressor(compression_params=tuned_parameters())
                      if level is None else zstandard.ZstdCompressor(level=level))
        self._dctx = zstandard.ZstdDecompressor()

    def compress_into(self, src: U8Array, dst: U8Array) -> int | None:
        """Compress `src` into `dst`; the stored size, or None if it does not fit."""
        packed: bytes = self._cctx.compress(src.data)
        if len(packed) > dst.size:
            return None
        dst[: len(packed)] = np.frombuffer(packed, np.uint8)
        return len(packed)

    def decompress_into(self, src: memoryview, dst: U8Array) -> None:
        """Decode exactly one frame holding exactly dst.size bytes into `dst`."""
        dst[:] = np.frombuffer(decode_frame(src, dst.size, what="plane", dctx=self._dctx),
                               np.uint8)


try:
    # python-zstandard's cffi binding of libzstd (shipped in its wheels, no public stub): it
    # lets zstd read and write numpy buffers in place, with the GIL released for each call,
    # and set the literal-compression mode the public API does not expose.
    from zstandard import _cffi  # type: ignore[attr-defined,unused-ignore]

    _lib: Any = _cffi.lib
    _ffi: Any = _cffi.ffi
    _lib.ZSTD_c_literalCompressionMode  # noqa: B018 (older bindings lack it: use the public API)
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed wheel
    _lib = _ffi = None


class _LibZstd:
    """One thread's zstd contexts, called directly: no intermediate `bytes` either way."""

    def __init__(self, level: int | None) -> None:
        self._cctx = _ffi.gc(_lib.ZSTD_createCCtx(), _lib.ZSTD_freeCCtx)
        self._dctx = _ffi.gc(_lib.ZSTD_createDCtx(), _lib.ZSTD_freeDCtx)
        if level is None:
            params = {
                "strategy": _lib.ZSTD_fast, "windowLog": WINDOW_LOG, "hashLog": HASH_LOG,
                "minMatch": MIN_MATCH, "targetLength": ACCELERATION,
                "literalCompressionMode": 1,  # ZSTD_ps_enable
            }  # fmt: skip
        else:
            params = {"compressionLevel": level}
        for name, value in {**params, "contentSizeFlag": 1, "checksumFlag": 0}.items():
            self._check(_lib.ZSTD_CCtx_setParameter(self._cctx, getattr(_lib, "ZSTD_c_" + name),
                                                    value))

    @staticmethod
    def _check(code: int) -> int:
        if _lib.ZSTD_isError(code):
            name = _ffi.string(_lib.ZSTD_getErrorName(code)).decode()
            raise zstandard.ZstdError(f"zstd: {name}")
        return code

    # Every cffi view of a Python buffer is released on the way out (the `with`s), error or
    # not: one left to the garbage collector keeps its memoryview exported, and collecting
    # such a cycle at exit crashed the interpreter after a corrupt blob was refused.
    def compress_into(self, src: U8Array, dst: U8Array) -> int | None:
        with _ffi.from_buffer(dst) as target, _ffi.from_buffer(src) as source:
            code: int = _lib.ZSTD_compress2(self._cctx, target, dst.size, source, src.size)
        if _lib.ZSTD_isError(code):
            if _lib.ZSTD_getErrorCode(code) == _lib.ZSTD_error_dstSize_tooSmall:
                return None
            self._check(code)
        return code

    def decompress_into(self, src: memoryview, dst: U8Array) -> None:
        n = dst.size
        with _ffi.from_buffer(src) as source, _ffi.from_buffer(dst) as target:
            problem = self._decompress(source, src.nbytes, target, n)
        if problem is not None:
            raise IntegrityError(problem)

    def _decompress(self, source: Any, size: int, target: Any, n: int) -> str | None:
        declared = _lib.ZSTD_getFrameContentSize(source, size)
        if declared >= _lib.ZSTD_CONTENTSIZE_ERROR:  # no frame, or no size in it
            return "corrupt zstd plane: no frame with a content size"
        if declared != n:
            return f"zstd plane declares {declared} bytes, expected {n}"
        if _lib.ZSTD_findFrameCompressedSize(source, size) != size:
            # A second frame after the first, or a frame cut short.
            return "corrupt zstd plane: not exactly one frame"
        code = _lib.ZSTD_decompressDCtx(self._dctx, target, n, source, size)
        if _lib.ZSTD_isError(code):
            return f"corrupt zstd plane: {_ffi.string(_lib.ZSTD_getErrorName(code)).decode()}"
        if code != n:
            return f"zstd plane decoded to {code} bytes, expected {n}"
        return None


ZstdBackend = _LibZstd | _Zstd
HAVE_LIBZSTD = _lib is not None


# --- planes ------------------------------------------------------------------------------


def _uint(width: int) -> np.dtype[Any]:
    return np.dtype(f"<u{width}")


def split_plane(values: npt.NDArray[Any], j: int, rotated: bool, out: U8Array,
                tmp: U8Array) -> None:
    """Byte j of each value (rotated left one bit first, if `rotated`) into `out`.

    Each step is one ufunc over the whole array, writing bytes directly (the unsafe cast
    keeps the low byte): no wide temporaries, and the GIL is dropped for each.
    """
    bits = values.dtype.itemsize * 8
    if not rotated:
        np.right_shift(values, 8 * j, out=out, casting="unsafe")
    elif j:
        # The rotation's wrapped bit lands in byte 0 only: byte j is just a shift.
        np.right_shift(values, 8 * j - 1, out=out, casting="unsafe")
    else:
        np.left_shift(values, 1, out=out, casting="unsafe")
        np.right_shift(values, bits - 1, out=tmp, casting="unsafe")  # the sign, to bit 0
        np.bitwise_or(out, tmp, out=out)


def split_planes(seg: memoryview, width: int, rotated: bool, scratch: _Scratch) -> list[U8Array]:
    """Byte plane j of each `width`-byte little-endian value, in scratch arrays."""
    n = seg.nbytes // width
    values: npt.NDArray[Any] = np.frombuffer(seg, _uint(width), n)
    tmp = scratch.get(np.uint8, n, 1)
    planes = []
    for j in range(width):
        plane = scratch.get(np.uint8, n, 10 + j)
        split_plane(values, j, rotated, plane, tmp)
        planes.append(plane)
    return planes


# Values merged per pass of merge_planes: its passes over one block of them (the output,
# the planes and a temporary, ~1.5 MB for BF16) run in a core's L2 instead of streaming a
# whole chunk's planes through memory once per pass (3.7 against 2.4 GB/s for BF16).
MERGE_BLOCK = 1 << 17


def merge_planes(planes: list[U8Array], width: int, rotated: bool, out: memoryview,
                 scratch: _Scratch) -> None:
    """Inverse of split_planes, written into `out` (exactly n * width bytes)."""
    n = out.nbytes // width
    values = np.frombuffer(out, _uint(width), n)
    tmp = scratch.get(values.dtype, min(n, MERGE_BLOCK), 1)
    for lo in range(0, n, MERGE_BLOCK):
        hi = min(lo + MERGE_BLOCK, n)
        _merge_block([p[lo:hi] for p in planes], rotated, values[lo:hi], tmp[: hi - lo])


def _merge_block(planes: list[U8Array], rotated: bool, values: npt.NDArray[Any],
                 tmp: npt.NDArray[Any]) -> None:
    bits = values.dtype.itemsize * 8
    # Same-type ufuncs after one widening copy each: a mixed-type ufunc goes through numpy's
    # buffered cast loop, ~1.5x slower.
    np.copyto(values, planes[0], casting="unsafe")
    if rotated:
        np.left_shift(values, bits - 1, out=tmp)  # bit 0 of byte 0 is the sign
        np.right_shift(values, 1, out=values)
        np.bitwise_or(values, tmp, out=values)
    for j in range(1, len(planes)):
        np.copyto(tmp, planes[j], casting="unsafe")
        np.left_shift(tmp, 8 * j - int(rotated), out=tmp)
        np.bitwise_or(values, tmp, out=values)


class ByteGroupCodec:
    """Thread-safe: zstd contexts and scratch buffers are per thread."""

    name = NAME

    def __init__(self, level: int | None = None, *, libzstd: bool = HAVE_LIBZSTD) -> None:
        if level is not None and not -7 <= level <= 22:
            raise UsageError(f"zstd level must be between -7 and 22, got {level}")
        if libzstd and not HAVE_LIBZSTD:
            raise UsageError("this zstandard install has no libzstd binding")
        # Level 1 is zstd's default effort, which push asks for unless told otherwise; on byte
        # planes the tuned parameters are its equivalent (as small, 2-3x faster on exponent
        # planes), so only another level means zstd's own parameters on each plane.
        self.level = None if level == 1 else level
        self._backend: type[_LibZstd] | type[_Zstd] = _LibZstd if libzstd else _Zstd
        self._local = threading.local()
        self._scratch = _Scratch()

    def _zstd(self) -> ZstdBackend:
        z: ZstdBackend | None = getattr(self._local, "zstd", None)
        if z is None:
            z = self._local.zstd = self._backend(self.level)
        return z

    # --- encode ----------------------------------------------------------------------

    def encode(self, data: Buffer) -> Buffer:
        """The body, as a view of one fresh buffer that nothing else refers to."""
        view = memoryview(data).cast("B")
        segments = hint_segments(view)
        at = HEAD.size + sum(SEGMENT.size + s.width * PLANE.size for s in segments)
        # Every plane is stored raw or smaller, so the body never outgrows this; pages past
        # what is written are never touched.
        body = np.empty(at + view.nbytes, np.uint8)
        descriptors = [HEAD.pack(BODY_VERSION, len(segments))]
        for seg in segments:
            piece = view[seg.offset : seg.offset + seg.length]
            descriptors.append(SEGMENT.pack(seg.width, seg.rotated, seg.length))
            if seg.width == 1:
                method, stored = self._store(np.frombuffer(piece, np.uint8), body, at, False)
                descriptors.append(PLANE.pack(method, stored))
                at += stored
                continue
            n = seg.length // seg.width
            values = np.frombuffer(piece, _uint(seg.width), n)
            tmp = self._scratch.get(np.uint8, n, 1)
            for j in range(seg.width):
                # Built where the body keeps it raw: a plane that stays raw is never copied.
                plane = body[at : at + n]
                split_plane(values, j, seg.rotated, plane, tmp)
                method, stored = self._store(plane, body, at, True)
                descriptors.append(PLANE.pack(method, stored))
                at += stored
        head = b"".join(descriptors)
        body[: len(head)] = np.frombuffer(head, np.uint8)
        return body.data[:at]

    def _store(self, plane: U8Array, body: U8Array, at: int, in_place: bool
               ) -> tuple[int, int]:
        """Put `plane` at body[at:], compressed if that pays; (method, stored bytes).

        `in_place`: the plane already lies at body[at:] (then storing it raw costs nothing).
        """
        n = plane.size
        # A small plane (a chunk's header) costs less to try than to sample.
        if n < TRY_BELOW or sampled_entropy(plane) <= RAW_ENTROPY:
            # Saving under 1/64 is not worth a decompression on every read: a frame that
            # does not fit in that much is not kept.
            room = n - (n >> 6)
            dst = self._scratch.get(np.uint8, room, 2) if in_place else body[at : at + room]
            stored = self._zstd().compress_into(plane, dst)
            if stored is not None:
                if in_place:
                    body[at : at + stored] = dst[:stored]
                return ZSTD, stored
        if not in_place:
            body[at : at + n] = plane
        return RAW, n

    # --- decode ----------------------------------------------------------------------

    def decode(self, body: memoryview, size: int) -> Buffer:
        out = np.empty(size, np.uint8).data
        self.decode_into(body, out)
        return out

    def decode_into(self, body: memoryview, out: memoryview) -> None:
        """Decode into `out`, whose length is the declared size (lets callers reuse buffers)."""
        size = out.nbytes
        layout = list(_parse_body(memoryview(body).cast("B"), size))
        pos = 0
        zstd = self._zstd()
        for width, rotated, length, planes in layout:
            target = out[pos : pos + length]
            pos += length
            n = length // width
            if width == 1:
                ((method, stored),) = planes
                if method == RAW:
                    target[:] = stored
                else:  # straight into the output
                    zstd.decompress_into(stored, np.frombuffer(target, np.uint8))
                continue
            decoded = []
            for j, (method, stored) in enumerate(planes):
                if method == RAW:
                    decoded.append(np.frombuffer(stored, np.uint8))
                else:
                    plane = self._scratch.get(np.uint8, n, 10 + j)
                    zstd.decompress_into(stored, plane)
                    decoded.append(plane)
            merge_planes(decoded, width, rotated, target, self._scratch)




def _parse_body(body: memoryview, size: int
                ) -> Iterator[tuple[int, bool, int, list[tuple[int, memoryview]]]]:
    """Validate the whole body layout against `size` before anything is decoded."""
    for width, rotated, length, planes in parse_layout(
            lambda at, n: body[at : at + n], body.nbytes, size):
        yield width, rotated, length, [(m, body[at : at + n]) for m, at, n in planes]


def entropy_bound(data: Buffer) -> float:
    """Ratio an order-0 coder could reach on the byte planes `encode` would make (analysis)."""
    view = memoryview(data).cast("B")
    scratch = _Scratch()
    bits = 0.0
    for seg in hint_segments(view):
        piece = view[seg.offset : seg.offset + seg.length]
        planes = ([np.frombuffer(piece, np.uint8)] if seg.width == 1
                  else split_planes(piece, seg.width, seg.rotated, scratch))
        for plane in planes:
            counts = np.bincount(plane, minlength=256)
            p = counts[counts > 0] / max(plane.size, 1)
            bits += float(-(p * np.log2(p)).sum()) * plane.size
    return math.inf if bits == 0 else view.nbytes * 8 / bits

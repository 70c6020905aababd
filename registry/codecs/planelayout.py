"""The body layout of the `zstd-bytegroup` codec (docs/format.md §7): a head, one descriptor
per segment with one entry per byte plane, then the planes. Every length is checked against
the declared decoded size and the body before anything is decoded, whether the body is in
memory or read piecewise from a file."""

from __future__ import annotations

import struct
from collections.abc import Callable

from kvgraft.digest import Buffer
from kvgraft.errors import IntegrityError

BODY_VERSION = 1
WIDTHS = (1, 2, 4, 8)
RAW, ZSTD = 0, 1  # how a plane is stored
HEAD = struct.Struct("<BI")  # version, segment count
SEGMENT = struct.Struct("<BBQ")  # width, rotated, decoded length
PLANE = struct.Struct("<BQ")  # method, stored length

Plane = tuple[int, int]  # (method, stored length) as the segment descriptor gives it
Layout = list[tuple[int, bool, int, list[tuple[int, int, int]]]]


def parse_layout(read_at: Callable[[int, int], Buffer], nbytes: int, size: int) -> Layout:
    """The segments of a body of `nbytes` (read through `read_at(offset, n)`) that must
    decode to `size` bytes: (width, rotated, length, [(method, offset, stored length)]),
    every length checked against `size` and the body before anything is decoded."""
    segments, at = _descriptors(read_at, nbytes, size)
    layout: Layout = []
    for width, rotated, length, planes in segments:
        n = length // width
        placed = []
        for method, stored in planes:
            if at + stored > nbytes:
                raise IntegrityError("bytegroup body is truncated")
            if method == RAW and stored != n:
                raise IntegrityError(f"raw plane holds {stored} bytes, expected {n}")
            placed.append((method, at, stored))
            at += stored
        layout.append((width, rotated, length, placed))
    if at != nbytes:
        raise IntegrityError(f"bytegroup body has {nbytes - at} bytes of trailing data")
    return layout


def _unpack(read_at: Callable[[int, int], Buffer], nbytes: int, at: int,
            fmt: struct.Struct) -> tuple[tuple[int, ...], int]:
    """The values of `fmt` at `at`, and the offset after them."""
    if at + fmt.size > nbytes:
        raise IntegrityError("bytegroup body is truncated")
    return fmt.unpack(read_at(at, fmt.size)), at + fmt.size


def _descriptors(read_at: Callable[[int, int], Buffer], nbytes: int, size: int
                 ) -> tuple[list[tuple[int, bool, int, list[Plane]]], int]:
    """The head and every segment descriptor, checked against `size`; and where the plane
    data starts."""
    (version, count), at = _unpack(read_at, nbytes, 0, HEAD)
    if version != BODY_VERSION:
        raise IntegrityError(f"bytegroup body has unknown version {version}")
    # Each segment takes at least one descriptor and one plane entry: a count that could not
    # fit in the body is corrupt (and must not drive a long loop).
    if count * (SEGMENT.size + PLANE.size) > nbytes:
        raise IntegrityError(f"bytegroup body claims {count} segments, more than it can hold")
    segments = []
    total = 0
    for _ in range(count):
        (width, rotated, length), at = _unpack(read_at, nbytes, at, SEGMENT)
        _check_segment(width, rotated, length)
        total += length
        if total > size:
            raise IntegrityError(f"bytegroup body decodes to more than the declared {size} bytes")
        planes: list[Plane] = []
        for _ in range(width):
            (method, stored), at = _unpack(read_at, nbytes, at, PLANE)
            planes.append((method, stored))
        for method, _ in planes:
            if method not in (RAW, ZSTD):
                raise IntegrityError(f"bytegroup plane has unknown method {method}")
        segments.append((width, bool(rotated), length, planes))
    if total != size:
        raise IntegrityError(f"bytegroup body decodes to {total} bytes, expected {size}")
    return segments, at


def _check_segment(width: int, rotated: int, length: int) -> None:
    if width not in WIDTHS or rotated not in (0, 1) or (rotated and width == 1):
        raise IntegrityError(f"bytegroup segment has bad width {width} or rotation")
    if length == 0 or length % width:
        raise IntegrityError(f"bytegroup segment of {length} bytes does not fit width {width}")

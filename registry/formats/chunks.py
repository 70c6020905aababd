"""How a KV file is cut into chunks along the token axis, and put back together.

Chunk c holds, for every layer, the key/value slices for the absolute positions
[c*C, (c+1)*C) that the layer holds, as a safetensors payload with tensors shaped
[kv_heads, span, head_dim]. In the KV file a tensor is row-major [H, T, D], so each
(tensor, head) contributes one contiguous run of bytes: a chunk is a gather of H runs per
tensor, and rebuilding the file is the matching scatter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvgraft.errors import IntegrityError, InvalidKVFile
from kvgraft.formats.kvfile import KVLayout, TensorInfo, safetensors_header

if TYPE_CHECKING:
    from kvgraft.formats.manifest import Manifest

DEFAULT_CHUNK_TOKENS = 256
_IOV_MAX = 1024
MAX_CHUNK_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class Run:
    """`length` bytes at `file_offset` in the KV file go to `offset` in the chunk payload."""

    file_offset: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    index: int
    start: int  # absolute token positions [start, end)
    end: int
    header: bytes  # safetensors header of the payload (length prefix included)
    runs: tuple[Run, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(r.length for r in self.runs)


def _slice(
    t: TensorInfo, layer_start: int, a: int, b: int
) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """Shape and (file offset, length) runs of positions [a, b) of tensor t."""
    heads, length, dim = t.shape
    row = dim * t.itemsize
    span = (b - a) * row
    first = (a - layer_start) * row
    runs = [(t.begin + h * length * row + first, span) for h in range(heads)]
    return (heads, b - a, dim), runs


def plan_chunks(layout: KVLayout, chunk_tokens: int) -> list[ChunkPlan]:
    n = layout.token_count
    plans = []
    for c, lo in enumerate(range(0, n, chunk_tokens)):
        hi = min(lo + chunk_tokens, n)
        entries: list[tuple[str, str, tuple[int, ...], int]] = []
        pieces: list[list[tuple[int, int]]] = []
        for layer in layout.layers:
            a, b = max(lo, layer.start), hi
            if a >= b:
                continue  # a sliding-window layer that holds none of this span
            for t in (layer.key, layer.value):
                shape, runs = _slice(t, layer.start, a, b)
                entries.append((t.name, t.dtype, shape, sum(r[1] for r in runs)))
                pieces.append(runs)
        header = safetensors_header(entries)  # data follows in `entries` order
        pos = len(header)
        out: list[Run] = []
        for runs in pieces:
            for off, length in runs:
                out.append(Run(off, pos, length))
                pos += length
        plans.append(ChunkPlan(c, lo, hi, header, tuple(out)))
    return plans


def uncovered(layout: KVLayout, plans: list[ChunkPlan]) -> str | None:
    """None when the header, the token ids and the chunks' runs cover the file exactly once
    (then a file rebuilt from them holds no byte from anywhere else); else what is wrong."""
    spans = sorted([(0, layout.header_size),
                    (layout.token_ids.begin, layout.token_ids.end - layout.token_ids.begin),
                    *((r.file_offset, r.length) for p in plans for r in p.runs)])
    pos = 0
    for start, length in spans:
        if start != pos:
            return f"bytes {min(pos, start)}..{max(pos, start)} are " + (
                "written twice" if start < pos else "covered by no blob")
        pos += length
    if pos != layout.file_size:
        return f"the blobs cover {pos} bytes of a {layout.file_size}-byte file"
    return None


def manifest_plans(manifest: Manifest, layout: KVLayout) -> list[ChunkPlan]:
    """The chunk plans of an artifact whose header blob gave `layout`, checked against its
    manifest: the same chunks, spans and sizes, and with the header and the token ids
    covering the file exactly once, so that what is rebuilt from them is that file."""
    plans = plan_chunks(layout, manifest.chunk_tokens)
    if [(p.start, p.end, p.size) for p in plans] != \
            [(c.start, c.end, c.size) for c in manifest.chunks]:
        raise IntegrityError(f"manifest {manifest.digest} chunks do not match its header")
    gap = uncovered(layout, plans)
    if gap is not None:
        raise IntegrityError(f"artifact {manifest.digest} cannot be rebuilt: {gap}")
    return plans


def gather(fd: int, plan: ChunkPlan, buf: bytearray) -> memoryview:
    """Read the chunk payload of `plan` from the KV file `fd` into `buf` (reused)."""
    size = plan.size
    if len(buf) < size:
        buf.extend(bytes(size - len(buf)))
    view = memoryview(buf)[:size]
    view[: len(plan.header)] = plan.header
    for r in plan.runs:
        got = os.preadv(fd, [view[r.offset : r.offset + r.length]], r.file_offset)
        if got != r.length:
            raise InvalidKVFile(f"short read at offset {r.file_offset}: the KV file is "
                                "shorter than its header says (it changed?)")
    return view


def scatter_many(fd: int, items: list[tuple[ChunkPlan, memoryview]]) -> None:
    """Write several verified chunk payloads back into the KV file `fd`.

    The runs of one (tensor, head) in consecutive chunks are adjacent in the file, so a batch
    of consecutive chunks is written with one pwritev per (tensor, head) instead of one
    pwrite per run: far fewer syscalls, each of which would otherwise wait to take the GIL
    back from the decoding threads."""
    pieces = sorted((r.file_offset, payload[r.offset : r.offset + r.length])
                    for plan, payload in items for r in plan.runs)
    i = 0
    while i < len(pieces):
        start, first = pieces[i]
        bufs, end = [first], start + first.nbytes
        i += 1
        while i < len(pieces) and pieces[i][0] == end and len(bufs) < _IOV_MAX:
            bufs.append(pieces[i][1])
            end += pieces[i][1].nbytes
            i += 1
        if os.pwritev(fd, bufs, start) != end - start:
            raise OSError(f"short write at offset {start}")

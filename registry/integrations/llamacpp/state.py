"""llama.cpp's per-sequence state, converted to and from the KV file's tensors.

What llama.cpp writes for one sequence of a plain KV cache (`llama_kv_cache::state_write`,
the seq-state format version 3), all little-endian; `llama_state_seq_get_data` puts a u32
magic (0xaf143cd8) and the i32 sequence id before it, a seq-state file its own header:

    u32 n_stream (1)   u32 cell_count (T)
    T x { i32 pos, u32 n_seq_id (1), i32 seq_id }            cell metadata
    u32 v_trans   u32 n_layer
    n_layer x { i32 k_type, u64 k_row_bytes, T rows of [kv_heads * head_dim] }
    v_trans == 0: n_layer x { i32 v_type, u64 v_row_bytes, T rows }
    v_trans == 1: n_layer x { i32 v_type, u32 v_elem_bytes, u32 n_embd_v,
                              n_embd_v rows of T elements }   (V transposed)

A K row is one cell: its heads one after the other, so T rows are [T, kv_heads, head_dim]
and the KV file's [kv_heads, T, head_dim] is its transpose. V is the same without flash
attention's transposed layout, and [kv_heads * head_dim, T] with it (llama.cpp transposes V
when flash attention is off). Positions are 0..T-1 of one sequence: kvgraft stores the
token ids, and rebuilds the metadata as positions 0..n-1, one sequence id each (llama.cpp
replaces the id with the destination sequence when it reads). KV caches of quantized types
(q8_0, q4_0, ...) are refused: their blocks are not elements of a [heads, T, dim] tensor.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvgraft.errors import IncompatibleModel, InvalidKVFile, UsageError
from kvgraft.formats.kvfile import RawTensor
from kvgraft.fsutil import atomic_writer

SEQ_MAGIC = 0x67677371  # 'ggsq'
SEQ_VERSION = 3  # LLAMA_STATE_SEQ_VERSION of the llama.cpp llama-cpp-python 0.3.36 vendors
API_MAGIC = 0xAF143CD8  # before the state in llama_state_seq_get_data/set_data's buffers
# ggml type id -> (KV file dtype, numpy type of the same width); other types are refused
KV_TYPES = {0: ("F32", np.uint32), 1: ("F16", np.uint16), 30: ("BF16", np.uint16)}
GGML_IDS = {name: i for i, (name, _) in KV_TYPES.items()}
_META = 12  # bytes of one cell's metadata: pos, n_seq_id, seq_id


@dataclass(frozen=True, slots=True)
class Shape:
    """The KV layout a model's cache has in llama.cpp."""

    layers: int
    kv_heads: int
    head_dim: int  # of K
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class LayerKV:
    key: Any  # numpy [kv_heads, T, head_dim], a view of the state bytes (element-width ints)
    value: Any  # numpy [kv_heads, T, v_head_dim]
    dtype: str  # the KV file dtype of both


def strip_api_header(data: bytearray) -> memoryview:
    """The state body of a llama_state_seq_get_data buffer."""
    if len(data) < 8 or struct.unpack_from("<I", data)[0] != API_MAGIC:
        raise InvalidKVFile("llama.cpp sequence state does not start with its magic")
    return memoryview(data)[8:]


def api_header(seq_id: int = 0) -> bytes:
    return struct.pack("<Ii", API_MAGIC, seq_id)


def kv_type_name(ggml_type: int) -> str:
    if ggml_type in KV_TYPES:
        return KV_TYPES[ggml_type][0]
    from kvgraft.integrations.llamacpp.gguf import ggml_type_name

    raise UsageError(f"the KV cache type {ggml_type_name(ggml_type).lower()} is quantized: "
                     "kvgraft stores KV caches of f16, bf16 or f32 only",
                     hint="run llama.cpp with its default f16 KV cache (type_k, type_v)")


class _Cursor:
    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        if self.pos + n > len(self.data):
            raise InvalidKVFile("llama.cpp sequence state is truncated")
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += n
        return value

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise InvalidKVFile("llama.cpp sequence state is truncated")
        self.pos += n
        return self.data[self.pos - n : self.pos]


def _cells(c: _Cursor) -> int:
    """Read and check the cell metadata: positions 0..T-1 of one sequence."""
    if c.unpack("<I") != 1:
        raise UsageError("the llama.cpp context has more than one KV stream: kvgraft reads "
                         "single-stream caches (n_seq_max 1 or a unified cache)")
    count = int(c.unpack("<I"))
    if count == 0:
        raise UsageError("the llama.cpp sequence holds no tokens")
    meta = np.frombuffer(c.take(count * _META), dtype="<i4").reshape(count, 3)
    if not (np.array_equal(meta[:, 0], np.arange(count)) and (meta[:, 1] == 1).all()):
        raise UsageError("the llama.cpp sequence is not positions 0..T-1 of one sequence "
                         "(shifted or shared cells, or an M-RoPE cache): kvgraft cannot "
                         "store it")
    return count


def _rows(c: _Cursor, count: int, heads: int, dim: int, what: str) -> tuple[Any, str]:
    kind = int(c.unpack("<i"))
    name = kv_type_name(kind)
    width = np.dtype(KV_TYPES[kind][1]).itemsize
    row = int(c.unpack("<Q"))
    if row != heads * dim * width:
        raise IncompatibleModel(f"llama.cpp {what} rows are {row} bytes, the model's are "
                                f"{heads * dim * width}")
    flat = np.frombuffer(c.take(count * row), dtype=KV_TYPES[kind][1])
    return flat.reshape(count, heads, dim).transpose(1, 0, 2), name


def _columns(c: _Cursor, count: int, heads: int, dim: int) -> tuple[Any, str]:
    kind = int(c.unpack("<i"))
    name = kv_type_name(kind)
    width = np.dtype(KV_TYPES[kind][1]).itemsize
    if c.unpack("<I") != width or c.unpack("<I") != heads * dim:
        raise IncompatibleModel("llama.cpp transposed V does not have the model's shape")
    flat = np.frombuffer(c.take(count * heads * dim * width), dtype=KV_TYPES[kind][1])
    return flat.reshape(heads, dim, count).transpose(0, 2, 1), name


def parse_seq_state(data: bytes | bytearray | memoryview, shape: Shape,
                    ) -> tuple[int, bool, list[LayerKV]]:
    """(T, v_trans, per-layer K and V as [heads, T, dim] views) of one sequence's state."""
    c = _Cursor(memoryview(data).cast("B"))
    count = _cells(c)
    v_trans = int(c.unpack("<I"))
    n_layer = int(c.unpack("<I"))
    if v_trans not in (0, 1) or n_layer != shape.layers:
        raise IncompatibleModel(f"llama.cpp state has {n_layer} layers (v_trans {v_trans}), "
                                f"the model {shape.layers}")
    keys = [_rows(c, count, shape.kv_heads, shape.head_dim, "K") for _ in range(n_layer)]
    values = [(_columns(c, count, shape.kv_heads, shape.v_head_dim) if v_trans
               else _rows(c, count, shape.kv_heads, shape.v_head_dim, "V"))
              for _ in range(n_layer)]
    if c.pos != len(c.data):
        raise InvalidKVFile(f"llama.cpp sequence state has {len(c.data) - c.pos} bytes "
                            "past its last layer")
    layers = []
    for (k, kt), (v, vt) in zip(keys, values, strict=True):
        if kt != vt:
            raise UsageError(f"K is {kt} and V is {vt}: kvgraft stores one KV dtype")
        layers.append(LayerKV(k, v, kt))
    return count, bool(v_trans), layers


def kv_tensors(layers: Sequence[LayerKV]) -> list[tuple[RawTensor, RawTensor, int]]:
    """The KV file's (key, value, start) per layer: contiguous [heads, T, dim] copies."""
    out = []
    for layer in layers:
        k = np.ascontiguousarray(layer.key)
        v = np.ascontiguousarray(layer.value)
        out.append((RawTensor(layer.dtype, tuple(k.shape), k.data.cast("B")),
                    RawTensor(layer.dtype, tuple(v.shape), v.data.cast("B")), 0))
    return out


class SeqStateBuilder:
    """The state bytes llama.cpp reads back as the first `n` positions of one sequence,
    from per-layer [heads, T, dim] arrays (T >= n), after `prefix` (`api_header()` for
    llama_state_seq_set_data), filled token range by token range: `fill(start, end)` copies
    those positions of every layer's K and V into their places (a strided copy per tensor;
    numpy releases the GIL, so ranges fill in parallel).
    With `into` (grown if too small) the bytes are built there: a fresh buffer of a
    2048-token state costs more in page faults (~28 ms for 47 MB here) than the copies do."""

    def __init__(self, layers: Sequence[LayerKV], n: int, v_trans: bool, *,
                 prefix: bytes = b"", into: bytearray | None = None) -> None:
        if not layers or n <= 0:
            raise UsageError("nothing to restore")
        self.n = n
        meta = np.zeros((n, 3), dtype="<i4")
        meta[:, 0] = np.arange(n)
        meta[:, 1] = 1
        head = (prefix + struct.pack("<II", 1, n) + meta.tobytes()
                + struct.pack("<II", int(v_trans), len(layers)))
        # (header before the tensor, source [heads, T, dim], V transposed to [heads, dim, n])
        plan: list[tuple[bytes, Any, bool]] = []
        for layer in layers:
            row = layer.key.shape[0] * layer.key.shape[2] * layer.key.itemsize
            plan.append((struct.pack("<iQ", GGML_IDS[layer.dtype], row), layer.key, False))
        for layer in layers:
            v = layer.value
            if v_trans:
                plan.append((struct.pack("<iII", GGML_IDS[layer.dtype], v.itemsize,
                                         v.shape[0] * v.shape[2]), v, True))
            else:
                row = v.shape[0] * v.shape[2] * v.itemsize
                plan.append((struct.pack("<iQ", GGML_IDS[layer.dtype], row), v, False))
        self.size: int = len(head) + sum(len(h) + int(src[:, :n, :].nbytes)
                                         for h, src, _ in plan)
        out = bytearray(self.size) if into is None else into
        if len(out) < self.size:
            out.extend(bytes(self.size - len(out)))
        self.out = out
        out[: len(head)] = head
        pos = len(head)
        # (source, destination view of `out`: [n, heads, dim] rows or [heads, dim, n] columns)
        self._copies: list[tuple[Any, Any, bool]] = []
        for h, src, cols in plan:
            out[pos : pos + len(h)] = h
            pos += len(h)
            heads, _, dim = src.shape
            shape = (heads, dim, n) if cols else (n, heads, dim)
            dst = np.frombuffer(out, dtype=src.dtype, count=heads * dim * n, offset=pos)
            self._copies.append((src, dst.reshape(shape), cols))
            pos += heads * dim * n * src.itemsize

    def fill(self, start: int, end: int) -> None:
        """Copy positions [start, end) (clipped to the n built) of every K and V."""
        end = min(end, self.n)
        if start >= end:
            return
        for src, dst, cols in self._copies:
            part = src[:, start:end, :]
            if cols:
                # transposed into a contiguous block first, then rows into place: numpy's
                # element-wise strided copy straight into columns is ~1.4x slower
                dst[:, :, start:end] = np.ascontiguousarray(part.transpose(0, 2, 1))
            else:
                dst[start:end] = part.transpose(1, 0, 2)

    def release(self) -> int:
        """Drop the views into `out` (so it may grow again); the size of the state in it."""
        self._copies.clear()
        return self.size


def build_seq_state(layers: Sequence[LayerKV], n: int, v_trans: bool, *,
                    prefix: bytes = b"") -> bytearray:
    """SeqStateBuilder's bytes for the first `n` positions, filled at once, in new memory."""
    builder = SeqStateBuilder(layers, n, v_trans, prefix=prefix)
    builder.fill(0, n)
    builder.release()
    return builder.out


# --- seq-state files ('ggsq': llama_state_seq_save_file, llama-server's slot save) --------


# llama-server writes a slot's token list packed (server_tokens, tools/server): the marker
# LLAMA_TOKEN_NULL, the list's version, the count, the ids, then the count of media chunks
# (0 for text); it reads plain ids as well (what older servers and llama_state_seq_save_file
# write).
PACKED_MARKER = -1
PACKED_VERSION = 1


def read_seq_file(path: Path | str) -> tuple[list[int], bytes, bool]:
    """(token ids, state bytes, whether the token list is llama-server's packed one) of a
    seq-state file of the supported version."""
    data = Path(path).read_bytes()
    if len(data) < 12:
        raise UsageError(f"{path}: not a llama.cpp sequence state file (too short)")
    magic, version, n = struct.unpack_from("<III", data)
    if magic != SEQ_MAGIC:
        raise UsageError(f"{path}: not a llama.cpp sequence state file (magic {magic:08x})")
    if version != SEQ_VERSION:
        raise UsageError(f"{path}: llama.cpp sequence state version {version}; this kvgraft "
                         f"reads version {SEQ_VERSION} (older files are unreadable by the "
                         "llama.cpp it runs as well)")
    end = 12 + 4 * n
    if end > len(data):
        raise UsageError(f"{path}: token count {n} exceeds the file")
    tokens = [int(t) for t in np.frombuffer(data, dtype="<i4", count=n, offset=12)]
    packed = bool(tokens) and tokens[0] == PACKED_MARKER
    if packed:
        tokens = _unpack_tokens(path, tokens)
    return tokens, data[end:], packed


def _unpack_tokens(path: Path | str, packed: list[int]) -> list[int]:
    if len(packed) < 4 or packed[1] != PACKED_VERSION:
        raise UsageError(f"{path}: llama-server token list version "
                         f"{packed[1] if len(packed) > 1 else '?'}; this kvgraft reads "
                         f"version {PACKED_VERSION}")
    count = packed[2]
    if count < 0 or len(packed) != count + 4:
        raise UsageError(f"{path}: llama-server token list of {count} ids in "
                         f"{len(packed)} entries")
    if packed[3 + count] != 0:
        raise UsageError(f"{path}: the slot holds images or audio ({packed[3 + count]} media "
                         "chunks): their KV depends on more than token ids, not imported")
    return packed[3 : 3 + count]


def write_seq_file(path: Path | str, tokens: Sequence[int],
                   state: bytes | bytearray | memoryview, *, packed: bool = False) -> Path:
    """A seq-state file; `packed`: with llama-server's packed token list."""
    ids = list(tokens)
    if packed:
        ids = [PACKED_MARKER, PACKED_VERSION, len(ids), *ids, 0]
    target = Path(path)
    with atomic_writer(target) as f:
        f.write(struct.pack("<III", SEQ_MAGIC, SEQ_VERSION, len(ids)))
        f.write(np.asarray(ids, dtype="<i4").tobytes())
        f.write(state)
    return target

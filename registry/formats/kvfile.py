"""The KV file (docs/format.md §4): a safetensors file holding one graft.

The reader validates the header without touching tensor data, so a file of any size is
described in O(header) memory; tensor bytes are then read with `pread` into caller buffers.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgraft import strictjson
from kvgraft.digest import Buffer, Digest, canonical_json
from kvgraft.errors import InvalidKVFile, UsageError
from kvgraft.fsutil import atomic_writer, open_regular
from kvgraft.identity.model import ModelIdentity

FORMAT_VERSION = "1"
MAX_HEADER = 64 * 1024 * 1024  # a header this large is hostile, not a KV file
ITEMSIZE: Mapping[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E4M3FN": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_LAYER_TENSOR = re.compile(r"layers\.(0|[1-9][0-9]*)\.(key|value)")
_DIGEST_KEYS = ("model.architecture", "model.tokenizer", "model.weights")
# ASCII digits only (str.isdigit() also takes '٠', '０' and '²'), and few enough for int().
_START = re.compile(r"[0-9]{1,19}")
MODEL_NAME_MAX = 255  # the catalog's models.name column


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class LayerInfo:
    index: int
    start: int  # first absolute token position the layer holds
    key: TensorInfo
    value: TensorInfo

    @property
    def length(self) -> int:
        return self.key.shape[1]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A validated KV file header: everything about the file except the tensor bytes."""

    header_size: int  # 8 + JSON length: the header blob is file[0:header_size]
    file_size: int
    metadata: Mapping[str, str]
    tensors: tuple[TensorInfo, ...]  # in file order
    layers: tuple[LayerInfo, ...]
    token_ids: TensorInfo
    identity: ModelIdentity
    provenance: Mapping[str, Any] = field(default_factory=dict)

    @property
    def token_count(self) -> int:
        return self.token_ids.shape[0]

    @property
    def model_name(self) -> str:
        return self.metadata.get("model.name", "")

    @property
    def model_config(self) -> Mapping[str, Any]:
        raw = self.metadata.get("model.config")
        config: Mapping[str, Any] = strictjson.loads(raw) if raw else {}
        return config


def _bad(path: Path | str, why: str) -> InvalidKVFile:
    return InvalidKVFile(f"{path}: not a valid KV file: {why}")


def read_layout(path: Path | str) -> KVLayout:
    """Parse and validate a KV file header; raises InvalidKVFile on anything malformed."""
    try:
        # A FIFO or a device as input would block forever or never end: refused here.
        fd, st = open_regular(path, "KV file")
        with os.fdopen(fd, "rb") as f:
            file_size = st.st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _bad(path, "shorter than a safetensors header")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER or n + 8 > file_size:
                raise _bad(path, f"header length {n} does not fit a {file_size}-byte file")
            raw = f.read(n)
    except FileNotFoundError:
        raise UsageError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise UsageError(f"is a directory, not a KV file: {path}") from None
    return parse_header(raw, file_size, path)


def parse_header(raw: bytes, file_size: int, path: Path | str = "<kv>") -> KVLayout:
    try:
        header = strictjson.loads(raw)
    except ValueError as e:
        raise _bad(path, f"header is not JSON kvgraft accepts ({e})") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise _bad(path, "__metadata__ missing or not a string map")
    base = 8 + len(raw)
    tensors = sorted((_tensor(path, name, spec, base) for name, spec in header.items()),
                     key=lambda t: (t.begin, t.end))
    pos = base
    for t in tensors:
        if t.begin != pos:
            raise _bad(path, f"tensor {t.name} data is not contiguous at offset {t.begin}")
        pos = t.end
    if pos != file_size:
        raise _bad(path, f"tensor data ends at {pos} but the file has {file_size} bytes")
    return _kv_layout(path, base, file_size, meta, tuple(tensors))


def _tensor(path: Path | str, name: str, spec: Any, base: int) -> TensorInfo:
    if not isinstance(spec, dict):
        raise _bad(path, f"tensor {name!r} entry is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise _bad(path, f"tensor {name!r} has unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _bad(path, f"tensor {name!r} has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int and o >= 0 for o in offsets) and offsets[0] <= offsets[1]):
        raise _bad(path, f"tensor {name!r} has malformed data_offsets {offsets!r}")
    count = 1
    for d in shape:
        count *= d
    if count * ITEMSIZE[dtype] != offsets[1] - offsets[0]:
        raise _bad(path, f"tensor {name!r}: shape {shape} {dtype} does not match its byte span")
    return TensorInfo(name, dtype, tuple(shape), base + offsets[0], base + offsets[1])


def _kv_layout(path: Path | str, base: int, file_size: int, meta: dict[str, str],
               tensors: tuple[TensorInfo, ...]) -> KVLayout:
    if meta.get("kvgraft.format") != FORMAT_VERSION:
        raise _bad(path, f"kvgraft.format is {meta.get('kvgraft.format')!r}, expected '1'")
    identity = _identity(path, meta)
    by_name = {t.name: t for t in tensors}
    tok = by_name.pop("token_ids", None)
    if tok is None or tok.dtype != "I64" or len(tok.shape) != 1:
        raise _bad(path, "token_ids must be an int64 tensor of shape [N]")
    n = tok.shape[0]
    if n == 0:
        raise _bad(path, "token_ids is empty: a graft covers at least one token")
    pairs: dict[int, dict[str, TensorInfo]] = {}
    for name, t in by_name.items():
        m = _LAYER_TENSOR.fullmatch(name)
        if m is None:
            raise _bad(path, f"unexpected tensor {name!r}")
        pairs.setdefault(int(m.group(1)), {})[m.group(2)] = t
    if not pairs or sorted(pairs) != list(range(len(pairs))):
        raise _bad(path, "layers must be numbered 0..L-1 with no gaps")
    layers = tuple(_layer(path, i, pairs[i], meta, n) for i in range(len(pairs)))
    provenance: dict[str, Any] = {}
    if "provenance" in meta:
        provenance = _json_object(path, meta, "provenance")
    if "model.config" in meta:
        _json_object(path, meta, "model.config")
    name = meta.get("model.name", "")
    if len(name) > MODEL_NAME_MAX or not name.isprintable():
        raise _bad(path, f"model.name must be at most {MODEL_NAME_MAX} printable characters")
    return KVLayout(base, file_size, dict(meta), tensors, layers, tok, identity, provenance)


def _json_object(path: Path | str, meta: Mapping[str, str], key: str) -> dict[str, Any]:
    try:
        value = strictjson.loads(meta[key])
    except ValueError as e:
        raise _bad(path, f"{key} metadata is not JSON kvgraft accepts ({e})") from None
    if not isinstance(value, dict):
        raise _bad(path, f"{key} metadata is not a JSON object")
    return value


def _identity(path: Path | str, meta: Mapping[str, str]) -> ModelIdentity:
    for key in _DIGEST_KEYS[:2]:
        if key not in meta:
            raise _bad(path, f"metadata {key} is missing")
    try:
        return ModelIdentity.from_json(
            {"architecture": meta["model.architecture"], "tokenizer": meta["model.tokenizer"],
             "weights": meta.get("model.weights") or None})
    except UsageError as e:
        raise _bad(path, f"model identity: {e.message}") from None


def _layer(path: Path | str, i: int, kv: dict[str, TensorInfo], meta: Mapping[str, str],
           n: int) -> LayerInfo:
    if set(kv) != {"key", "value"}:
        raise _bad(path, f"layer {i} needs both key and value tensors")
    k, v = kv["key"], kv["value"]
    if len(k.shape) != 3 or len(v.shape) != 3:
        raise _bad(path, f"layer {i}: key/value must be [kv_heads, tokens, head_dim]")
    if k.shape[:2] != v.shape[:2] or k.dtype != v.dtype:
        raise _bad(path, f"layer {i}: key {k.shape} {k.dtype} and value {v.shape} {v.dtype} "
                         "disagree on heads, tokens or dtype")
    length = k.shape[1]
    raw_start = meta.get(f"layers.{i}.start", "0")
    if not _START.fullmatch(raw_start):
        raise _bad(path, f"layers.{i}.start is not a non-negative integer: {raw_start!r}")
    start = int(raw_start)
    if start + length != n:
        raise _bad(path, f"layer {i} holds positions [{start}, {start + length}) but a cache "
                         f"over {n} tokens must end at position {n}")
    return LayerInfo(i, start, k, v)


# --- writing -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RawTensor:
    """Tensor bytes in row-major order with their safetensors dtype and shape."""

    dtype: str
    shape: tuple[int, ...]
    data: Buffer


def safetensors_header(entries: Sequence[tuple[str, str, tuple[int, ...], int]],
                       metadata: Mapping[str, str] | None = None) -> bytes:
    """Header bytes (length prefix included) for tensors laid out back to back in order.

    `entries` are (name, dtype, shape, nbytes). The JSON has sorted keys and is space-padded
    to a multiple of 8 bytes so that identical content always gives identical bytes.
    """
    header: dict[str, Any] = {}
    pos = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def write_kvfile(path: Path | str, layers: Sequence[tuple[RawTensor, RawTensor, int]],
                 token_ids: Sequence[int] | Buffer, identity: ModelIdentity, *,
                 model_name: str = "", model_config: Mapping[str, Any] | None = None,
                 provenance: Mapping[str, Any] | None = None) -> Path:
    """Write a KV file atomically. `layers` holds (key, value, start) per layer, in order."""
    tok = (bytes(token_ids) if isinstance(token_ids, bytes | bytearray | memoryview)
           else struct.pack(f"<{len(token_ids)}q", *token_ids))
    meta = {"kvgraft.format": FORMAT_VERSION,
            "model.architecture": str(identity.architecture),
            "model.tokenizer": str(identity.tokenizer)}
    if identity.weights:
        meta["model.weights"] = str(identity.weights)
    if model_name:
        meta["model.name"] = model_name
    if model_config is not None:
        meta["model.config"] = canonical_json(model_config).decode()
    if provenance is not None:
        meta["provenance"] = canonical_json(provenance).decode()
    tensors: list[tuple[str, RawTensor]] = []
    for i, (k, v, start) in enumerate(layers):
        meta[f"layers.{i}.start"] = str(start)
        tensors += [(f"layers.{i}.key", k), (f"layers.{i}.value", v)]
    tensors.append(("token_ids", RawTensor("I64", (len(tok) // 8,), tok)))
    header = safetensors_header(
        [(name, t.dtype, t.shape, memoryview(t.data).nbytes) for name, t in tensors], meta)
    target = Path(path)
    with atomic_writer(target) as f:
        f.write(header)
        for _, t in tensors:
            f.write(t.data)
    read_layout(target)  # a writer that can produce an invalid file is a bug; fail loudly
    return target


def hash_file(fd: int, layout: KVLayout, block: int = 8 << 20) -> tuple[Digest, dict[str, Digest]]:
    """SHA-256 of the whole file and of each tensor's bytes, in one sequential pass."""
    import hashlib

    whole = hashlib.sha256()
    per = {t.name: hashlib.sha256() for t in layout.tensors}
    buf = bytearray(block)
    view = memoryview(buf)
    bounds = [(t.begin, t.end, per[t.name]) for t in layout.tensors]
    pos, i = 0, 0
    while pos < layout.file_size:
        n = os.preadv(fd, [view[: min(block, layout.file_size - pos)]], pos)
        if n <= 0:
            raise InvalidKVFile("KV file is shorter than its header says (it changed?)")
        whole.update(view[:n])
        lo, hi = pos, pos + n
        while i < len(bounds) and bounds[i][0] < hi:
            b, e, h = bounds[i]
            h.update(view[max(b, lo) - lo : min(e, hi) - lo])
            if e > hi:
                break
            i += 1
        pos = hi
    return Digest.from_hasher(whole), {k: Digest.from_hasher(h) for k, h in per.items()}

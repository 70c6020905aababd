"""A GGUF file's identity, read without loading the model: architecture, tokenizer, weights.

GGUF (llama.cpp's model file) is a header of typed key/value metadata and tensor
descriptors, then the tensor data. The three digests follow the rules of the other engines
(kvgraft.identity.fingerprint):

- architecture: the canonical JSON of the KV-relevant metadata: `general.architecture` and
  every `<arch>.*` hyperparameter except the context length (a runtime limit, not what the
  cached numbers mean), plus the layer and head counts under the names the compatibility
  report uses and the KV dtype;
- tokenizer: each `tokenizer.*` entry's encoded bytes as stored (tokens, merges, token
  types, special ids, pre-tokenizer), hashed per key; the chat template is left out, since
  it decides which text is rendered, not how a text becomes tokens;
- weights: `weights_digest` over (name, ggml type, shape, SHA-256 of the bytes) of every
  tensor, streamed from the file; quantized tensors are hashed as stored, so the same
  weights quantized differently are different weights. The per-tensor digests are cached
  under the kvgraft cache, keyed by the file's size, mtime and inode.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.digest import Digest, canonical_json
from kvgraft.errors import InvalidKVFile, RegistryError, UsageError
from kvgraft.fsutil import MiB, atomic_writer, read_bounded
from kvgraft.identity.fingerprint import TensorDigest, weights_digest

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 32  # more entries than this is a hostile header, not a model
_BLOCK = 8 << 20
_DECODED_STRINGS = 64  # longer string arrays are skipped over, not decoded
CACHE_VERSION = 1
_SKIP_ARCH = ("context_length",)
_SKIP_TOKENIZER = ("tokenizer.chat_template",)
# ggml type id -> (name, elements per block, bytes per block), as ggml.h defines them. The
# table is here rather than read from the gguf package, whose import takes seconds.
GGML_TYPES: Mapping[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class StringArray:
    """A long array of strings (a vocabulary, merges), not decoded: its bytes are in `raw`."""

    count: int


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] (the row) first
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    version: int
    metadata: Mapping[str, Any]  # decoded values
    raw: Mapping[str, bytes]  # each entry's type tag and value bytes, as stored
    tensors: tuple[GGUFTensor, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def is_gguf(path: Path | str) -> bool:
    """A file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


class _Reader:
    """Little-endian reads over a mapped file, bounded by its size."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.pos, self.size, self.path = data, 0, len(data), path

    def take(self, n: int) -> bytes:
        if n > self.size - self.pos:
            raise InvalidKVFile(f"{self.path}: truncated GGUF header")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        if n > self.size - self.pos:
            raise InvalidKVFile(f"{self.path}: truncated GGUF header")
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += n
        return value

    def count(self) -> int:
        n = int(self.unpack("<Q"))
        if n > _MAX_COUNT or n > self.size:
            raise InvalidKVFile(f"{self.path}: implausible GGUF count {n}")
        return n

    def skip_strings(self, n: int) -> None:
        data, pos, size = self.data, self.pos, self.size
        for _ in range(n):
            if pos + 8 > size:
                raise InvalidKVFile(f"{self.path}: truncated GGUF header")
            pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        if pos > size:
            raise InvalidKVFile(f"{self.path}: truncated GGUF header")
        self.pos = pos

    def string(self) -> str:
        try:
            return self.take(self.count()).decode("utf-8")
        except UnicodeDecodeError:
            return ""  # a token that is not UTF-8 (byte tokens): its bytes are in `raw`

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, n = int(self.unpack("<I")), self.count()
            if inner in _SCALARS:
                fmt = _SCALARS[inner]
                data = self.take(struct.calcsize(fmt) * n)
                return list(struct.unpack(f"<{n}{fmt[1]}", data))
            if inner == _STRING and n > _DECODED_STRINGS:
                self.skip_strings(n)
                return StringArray(n)
            return [self.value(inner) for _ in range(n)]
        raise InvalidKVFile(f"{self.path}: unknown GGUF value type {kind}")


def ggml_type_name(ggml_type: int) -> str:
    return GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else f"ggml_type_{ggml_type}"


def read_gguf(path: Path | str) -> GGUFFile:
    """Parse a GGUF file's header (metadata and tensor descriptors); no tensor data is read."""
    p = Path(path)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        r = _Reader(data, p)
        if r.take(4) != MAGIC:
            raise UsageError(f"{p}: not a GGUF file")
        version = int(r.unpack("<I"))
        if version not in (2, 3):
            raise UsageError(f"{p}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = r.count(), r.count()
        meta: dict[str, Any] = {}
        raw: dict[str, bytes] = {}
        for _ in range(n_kv):
            key = r.string()
            kind = int(r.unpack("<I"))
            start = r.pos
            meta[key] = r.value(kind)
            raw[key] = struct.pack("<I", kind) + data[start : r.pos]
        infos = []
        for _ in range(n_tensors):
            name = r.string()
            dims = int(r.unpack("<I"))
            if dims > 8:
                raise InvalidKVFile(f"{p}: tensor {name} has {dims} dimensions")
            shape = tuple(int(r.unpack("<Q")) for _ in range(dims))
            infos.append((name, shape, int(r.unpack("<I")), int(r.unpack("<Q"))))
        align = int(meta.get("general.alignment", 32)) or 32
        base = -(-r.pos // align) * align
        size = r.size
    tensors = []
    for name, shape, kind, offset in infos:
        if kind not in GGML_TYPES:
            raise UsageError(f"{p}: tensor {name} has ggml type {kind}, which this kvgraft "
                             "does not know the size of")
        _, block, nbytes = GGML_TYPES[kind]
        count = 1
        for d in shape[1:]:
            count *= d
        total = (shape[0] // block if shape else 1) * nbytes * count
        if base + offset + total > size:
            raise InvalidKVFile(f"{p}: tensor {name} lies past the end of the file")
        tensors.append(GGUFTensor(name, shape, kind, base + offset, total))
    return GGUFFile(p, version, meta, raw, tuple(tensors))


# --- the three digests -------------------------------------------------------------------


def _head_count(value: Any, what: str) -> int:
    """A head count, given per layer in some files: one value for every layer or refused."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise UsageError(f"{what} differs between layers ({sorted(set(value))}); "
                             "kvgraft handles one KV layout for every layer")
        return int(value[0])
    return int(value)


def arch_config(g: GGUFFile, kv_dtype: str) -> dict[str, Any]:
    """The KV-relevant metadata, with the shape fields the compatibility report names."""
    arch = g.architecture
    if not arch:
        raise UsageError(f"{g.path}: no general.architecture in the GGUF metadata")
    prefix = f"{arch}."
    out: dict[str, Any] = {"format": "gguf", "general.architecture": arch}
    for key, value in g.metadata.items():
        if key.startswith(prefix) and key[len(prefix):] not in _SKIP_ARCH:
            out[key] = (str(Digest.of(g.raw[key])) if isinstance(value, StringArray)
                        else value)
    try:
        layers = int(out[f"{arch}.block_count"])
        heads = _head_count(out[f"{arch}.attention.head_count"], "attention.head_count")
        embd = int(out[f"{arch}.embedding_length"])
    except KeyError as e:
        raise UsageError(f"{g.path}: the GGUF metadata has no {e.args[0]}") from None
    kv_heads = _head_count(out.get(f"{arch}.attention.head_count_kv", heads),
                           "attention.head_count_kv")
    out.update({"num_hidden_layers": layers, "num_attention_heads": heads,
                "num_key_value_heads": kv_heads,
                "head_dim": int(out.get(f"{arch}.attention.key_length", embd // heads)),
                "v_head_dim": int(out.get(f"{arch}.attention.value_length", embd // heads)),
                "kv_dtype": kv_dtype})
    return out


def tokenizer_digest(g: GGUFFile) -> Digest:
    entries = {key: hashlib.sha256(value).hexdigest() for key, value in g.raw.items()
               if key.startswith("tokenizer.") and not key.startswith(_SKIP_TOKENIZER)}
    if not entries:
        raise UsageError(f"{g.path}: the GGUF file has no tokenizer metadata")
    return Digest.of(canonical_json({"format": "gguf", "tokenizer": entries}))


def tokenizer_summary(g: GGUFFile) -> dict[str, Any]:
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    size = tokens.count if isinstance(tokens, StringArray) else None
    return {"model": g.metadata.get("tokenizer.ggml.model"),
            "pre": g.metadata.get("tokenizer.ggml.pre"),
            "size": len(tokens) if isinstance(tokens, list) else size}


def hash_tensors(g: GGUFFile) -> list[TensorDigest]:
    """Per-tensor digests, each tensor's bytes read once in blocks."""
    out = []
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(g.path, "rb") as f:
        for t in sorted(g.tensors, key=lambda t: t.offset):
            h = hashlib.sha256()
            pos, end = t.offset, t.offset + t.nbytes
            while pos < end:
                got = os.preadv(f.fileno(), [view[: min(_BLOCK, end - pos)]], pos)
                if got <= 0:
                    raise InvalidKVFile(f"{g.path}: truncated tensor {t.name}")
                h.update(view[:got])
                pos += got
            out.append(TensorDigest(t.name, ggml_type_name(t.ggml_type), t.shape,
                                    Digest.from_hasher(h)))
    return out


def _cache_path(cache_dir: Path, path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()
    return cache_dir / "fingerprints" / f"gguf-{key}.json"


def gguf_weights_digest(g: GGUFFile, cache_dir: Path | None) -> Digest:
    """The weights digest, from the cache when the file is unchanged (size, mtime, inode)."""
    st = g.path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    cache = _cache_path(cache_dir, g.path) if cache_dir is not None else None
    if cache is not None and cache.is_file():
        try:
            data = json.loads(read_bounded(cache, 64 * MiB, "GGUF weights digest cache"))
            if data.get("version") == CACHE_VERSION and data.get("stamp") == stamp:
                return weights_digest([TensorDigest.from_json(t) for t in data["tensors"]])
        except (OSError, ValueError, KeyError, RegistryError):  # a bad cache is recomputed
            pass
    tensors = hash_tensors(g)
    if cache is not None:
        with atomic_writer(cache, durable=False) as f:
            f.write(canonical_json({"version": CACHE_VERSION, "path": str(g.path.resolve()),
                                    "stamp": stamp,
                                    "tensors": [t.to_json() for t in tensors]}))
    return weights_digest(tensors)


def model_name(g: GGUFFile) -> str:
    name = g.metadata.get("general.name") or g.path.stem
    return str(name)[:255]

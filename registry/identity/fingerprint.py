"""Model fingerprints (docs/format.md §3): architecture, tokenizer and weights digests.

- architecture: SHA-256 of the canonical JSON of every config field that decides the KV
  layout or what the cached numbers mean, plus the KV dtype (`kv_config`).
- tokenizer: SHA-256 of the tokenizer files' contents (tokenizer.json, tokenizer.model,
  tokenizer_config.json, special tokens, vocabularies), read as bytes: no tokenizer is
  instantiated, so a model whose tokenizer needs an optional package, or that has no
  tokenizer files at all, still has an identity. Grafts made before this rule carry the
  digest of the instantiated tokenizer's definition (`legacy_tokenizer_digest`), which a
  live model recomputes so they still load (docs/format.md §3).
- weights: SHA-256 of the sorted list of (name, dtype, shape, SHA-256 of the bytes) of every
  stored tensor. A model directory's files are hashed once and the per-file results cached
  under the kvgraft cache keyed by file size and mtime, so grafting never rehashes weights.
  A live model is hashed tensor by tensor in memory with the same rule (tied aliases dropped
  the way `save_pretrained` drops them), so a saved model and its directory agree.

Everything here works on duck-typed config and tokenizer objects; only `fingerprint` of a
live model and `fingerprint_dir` need torch / transformers, imported when called.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgraft.digest import Digest, canonical_json
from kvgraft.errors import InvalidKVFile, MissingExtra, RegistryError, UsageError
from kvgraft.fsutil import MiB, atomic_writer, read_bounded
from kvgraft.identity.model import ModelIdentity

# Config fields that decide the KV layout or the meaning of the cached keys and values.
# Absent fields are left out, so a field a newer transformers adds with its old default
# does not change old digests unless a model actually sets it.
KV_FIELDS = (
    "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_size", "intermediate_size", "vocab_size", "hidden_act",
    "hidden_activation", "rms_norm_eps", "layer_norm_eps", "norm_eps",
    "rope_parameters", "rope_theta", "rope_scaling", "rope_local_base_freq",
    "partial_rotary_factor", "rotary_dim", "max_position_embeddings",
    "original_max_position_embeddings", "sliding_window", "sliding_window_pattern",
    "layer_types", "attention_chunk_size", "no_rope_layers", "no_rope_layer_interval",
    "num_kv_shared_layers", "kv_sharing_modes", "attn_logit_softcapping",
    "final_logit_softcapping", "query_pre_attn_scalar", "attention_multiplier",
    "embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_bias",
    "mlp_bias", "use_qk_norm", "qk_layernorm", "use_bidirectional_attention",
    "tie_word_embeddings", "pretraining_tp", "kv_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "use_sliding_window", "max_window_layers",
)  # fmt: skip
_TOKENIZER_RUNTIME_KEYS = ("truncation", "padding")  # call-time settings, not the definition
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
_BLOCK = 8 << 20
WEIGHTS_CACHE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A model's identity plus the config values the architecture digest covers."""

    identity: ModelIdentity
    config: Mapping[str, Any]
    name: str = ""
    tokenizer_summary: Mapping[str, Any] = field(default_factory=dict)
    # the tokenizer digest grafts made before the files rule carry (docs/format.md §3),
    # known only where a tokenizer was instantiated anyway; never part of the identity
    legacy_tokenizer: Digest | None = None

    def to_json(self) -> dict[str, Any]:
        return {**self.identity.to_json(), "name": self.name, "config": dict(self.config),
                "tokenizer_summary": dict(self.tokenizer_summary)}


def _plain(value: Any) -> Any:
    """JSON-safe copy of a config value (tuples become lists, nested configs dicts)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "to_dict"):
        return _plain(value.to_dict())
    if isinstance(value, float) and value != value:  # NaN has no canonical JSON form
        return "nan"
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            return getter(decoder=True)
        except TypeError:
            return getter()
    return config


def layer_types_of(config: Any) -> list[str]:
    """The per-layer attention kinds, inferred the way transformers' caches infer them."""
    declared = getattr(config, "layer_types", None)
    if declared is not None:
        return [str(t) for t in declared]
    n = int(config.num_hidden_layers)
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * n
    return ["full_attention"] * n


def kv_config(config: Any, kv_dtype: str) -> dict[str, Any]:
    """The KV-relevant view of a transformers config, with the KV dtype (safetensors name)."""
    cfg = text_config(config)
    out: dict[str, Any] = {}
    for name in KV_FIELDS:
        value = getattr(cfg, name, None)
        if value is not None:
            out[name] = _plain(value)
    if "rope_parameters" in out:  # transformers 5 exposes the older names as aliases of it
        out.pop("rope_scaling", None)
        out.pop("rope_theta", None)
    if "head_dim" not in out and "hidden_size" in out and "num_attention_heads" in out:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if "num_key_value_heads" not in out and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]
    out["layer_types"] = layer_types_of(cfg)
    out["kv_dtype"] = kv_dtype
    return out


def architecture_digest(config: Mapping[str, Any]) -> Digest:
    return Digest.of(canonical_json(dict(config)))


# --- tokenizer ---------------------------------------------------------------------------


def tokenizer_definition(tokenizer: Any) -> dict[str, Any]:
    """The canonical definition of an instantiated Hugging Face tokenizer: what the legacy
    tokenizer digest hashes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        for key in _TOKENIZER_RUNTIME_KEYS:
            spec.pop(key, None)
    else:  # a slow tokenizer: its vocabulary is all there is to compare
        spec = {"vocab": dict(sorted(tokenizer.get_vocab().items()))}
    specials = getattr(tokenizer, "special_tokens_map", {}) or {}
    return {"tokenizer": spec, "special_tokens": _plain(dict(specials))}


def legacy_tokenizer_digest(tokenizer: Any) -> Digest:
    """The tokenizer digest of grafts made before the files rule (docs/format.md §3)."""
    return Digest.of(canonical_json(tokenizer_definition(tokenizer)))


# the files a Hugging Face tokenizer is loaded from (sentencepiece, fast, their
# configuration and chat template, which transformers 5 keeps apart): a model directory
# with none of them has no tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json",
                   "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json")
# the explicit identity of "no tokenizer": such a model is served token ids only
NO_TOKENIZER = Digest.of(canonical_json({"tokenizer": None}))
_MAX_TOKENIZER_FILE = 512 * MiB


def tokenizer_files_present(model_dir: Path) -> list[str]:
    return [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]


def _tokenizer_file_digest(path: Path) -> Digest:
    """A JSON file hashes as its canonical JSON (so formatting and key order do not count,
    nor tokenizer.json's call-time truncation and padding); any other file as its bytes."""
    if path.suffix != ".json":
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(_BLOCK):
                h.update(block)
        return Digest.from_hasher(h)
    data = read_bounded(path, _MAX_TOKENIZER_FILE, "tokenizer file")
    try:
        value = json.loads(data)
    except ValueError as e:  # not JSON or not UTF-8
        raise UsageError(f"tokenizer file {path} is not valid JSON: {e}") from None
    if path.name == "tokenizer.json" and isinstance(value, dict):
        for key in _TOKENIZER_RUNTIME_KEYS:
            value.pop(key, None)
    try:
        return Digest.of(canonical_json(value))
    except ValueError:  # NaN or infinity: canonical JSON has no form for them
        raise UsageError(f"tokenizer file {path} holds a number JSON cannot say") from None


def tokenizer_files(model_dir: Path) -> dict[str, Digest]:
    """The digest of each tokenizer file present in a model directory, by file name."""
    return {name: _tokenizer_file_digest(model_dir / name)
            for name in tokenizer_files_present(model_dir)}


def tokenizer_digest(model_dir: Path) -> Digest:
    """The tokenizer digest of a model directory, from its files' contents alone;
    `NO_TOKENIZER` for a directory without tokenizer files."""
    files = tokenizer_files(model_dir)
    if not files:
        return NO_TOKENIZER
    return Digest.of(canonical_json({"tokenizer_files": {k: str(v) for k, v in files.items()}}))


def _tokenizer_summary(tokenizer: Any) -> dict[str, Any]:
    vocab = getattr(tokenizer, "vocab_size", None)
    return {"class": type(tokenizer).__name__,
            "vocab_size": int(vocab) if isinstance(vocab, int) else None,
            "size": len(tokenizer) if hasattr(tokenizer, "__len__") else None}


def _dir_tokenizer_summary(model_dir: Path) -> dict[str, Any]:
    """What a model directory says of its tokenizer, read from its files (informative)."""
    files = sorted(tokenizer_files_present(model_dir))
    config = model_dir / "tokenizer_config.json"
    cls = None
    if config.is_file():
        try:
            value = json.loads(config.read_bytes())
            cls = value.get("tokenizer_class") if isinstance(value, dict) else None
        except ValueError:
            cls = None
    return {"class": cls if isinstance(cls, str) else None, "files": files}


# --- weights -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorDigest:
    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: Digest

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), str(self.digest)]

    @classmethod
    def from_json(cls, data: list[Any]) -> TensorDigest:
        return cls(str(data[0]), str(data[1]), tuple(int(d) for d in data[2]),
                   Digest.parse(data[3]))


def weights_digest(tensors: list[TensorDigest]) -> Digest:
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise UsageError("the model has two weight tensors with the same name")
    return Digest.of(canonical_json(sorted(t.to_json() for t in tensors)))


def hash_safetensors(path: Path) -> list[TensorDigest]:
    """Per-tensor digests of a safetensors file, reading each tensor's bytes once."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise InvalidKVFile(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_SAFETENSORS_HEADER or n + 8 > size:
            raise InvalidKVFile(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise InvalidKVFile(f"{path}: safetensors header is not JSON") from None
        header.pop("__metadata__", None)
        out = []
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        for name, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            lo, hi = spec["data_offsets"]
            h = hashlib.sha256()
            pos = 8 + n + lo
            end = 8 + n + hi
            while pos < end:
                got = os.preadv(f.fileno(), [view[: min(_BLOCK, end - pos)]], pos)
                if got <= 0:
                    raise InvalidKVFile(f"{path}: truncated tensor {name}")
                h.update(view[:got])
                pos += got
            out.append(TensorDigest(name, spec["dtype"], tuple(spec["shape"]),
                                    Digest.from_hasher(h)))
    return out


def weight_files(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("*.safetensors") if p.is_file())


def _cache_file(cache_dir: Path, model_dir: Path) -> Path:
    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()
    return cache_dir / "fingerprints" / f"weights-{key}.json"


def dir_weights_digest(model_dir: Path, cache_dir: Path | None) -> Digest | None:
    """Weights digest of a model directory's safetensors files (None when it has none).

    Each file's tensor digests are cached, keyed by its size, mtime and inode: an unchanged
    file is never read again; a rewritten one is."""
    files = weight_files(model_dir)
    if not files:
        return None
    cached: dict[str, Any] = {}
    cache_path = _cache_file(cache_dir, model_dir) if cache_dir is not None else None
    if cache_path is not None and cache_path.is_file():
        try:
            data = json.loads(read_bounded(cache_path, 64 * MiB, "weights digest cache"))
            if data.get("version") == WEIGHTS_CACHE_VERSION:
                cached = data.get("files", {})
        except (OSError, ValueError, RegistryError):  # a bad cache is recomputed
            cached = {}
    tensors: list[TensorDigest] = []
    fresh: dict[str, Any] = {}
    changed = False
    for p in files:
        st = p.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        entry = cached.get(p.name)
        if entry is not None and entry.get("stamp") == stamp:
            found = [TensorDigest.from_json(t) for t in entry["tensors"]]
        else:
            found = hash_safetensors(p)
            changed = True
        fresh[p.name] = {"stamp": stamp, "tensors": [t.to_json() for t in found]}
        tensors += found
    if cache_path is not None and (changed or set(fresh) != set(cached)):
        with atomic_writer(cache_path, durable=False) as f:
            f.write(canonical_json({"version": WEIGHTS_CACHE_VERSION,
                                    "dir": str(model_dir.resolve()), "files": fresh}))
    return weights_digest(tensors)


# --- torch-facing entry points -----------------------------------------------------------


def torch_dtype_name(dtype: Any) -> str:
    """The safetensors name of a torch dtype (torch.bfloat16 -> "BF16")."""
    names = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
             "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int8": "I8",
             "uint8": "U8", "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL"}
    text = str(dtype).removeprefix("torch.")
    if text not in names:
        raise UsageError(f"unsupported dtype {dtype}")
    return names[text]


def live_weights_digest(model: Any) -> Digest:
    """Weights digest of a model in memory, by the same rule as a saved directory."""
    try:
        import torch
    except ImportError:
        raise MissingExtra("hashing a live model's weights", "hf") from None
    state = dict(model.state_dict())
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        state = remove_tied_weights_from_state_dict(state, model)
    except ImportError:  # older transformers: drop later aliases of one storage
        seen: set[tuple[int, int]] = set()
        for name in list(state):
            t = state[name]
            key = (t.untyped_storage().data_ptr(), t.data_ptr())
            if key in seen:
                del state[name]
            seen.add(key)
    out = []
    for name, t in state.items():
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        out.append(TensorDigest(name, torch_dtype_name(t.dtype), tuple(t.shape),
                                Digest.of(memoryview(data))))
    return weights_digest(out)


def fingerprint(model: Any, tokenizer: Any, *, weights_dir: Path | None = None,
                cache_dir: Path | None = None) -> Fingerprint:
    """The identity of a live model. With `weights_dir`, the weights digest is that of the
    directory the model was loaded from (cached); otherwise the tensors in memory are hashed.
    The tokenizer digest is that of the files the tokenizer was loaded from (`weights_dir`,
    else the tokenizer's own `name_or_path`)."""
    kv_dtype = torch_dtype_name(model.dtype)
    config = kv_config(model.config, kv_dtype)
    if weights_dir is not None:
        weights = dir_weights_digest(weights_dir, cache_dir)
    else:
        weights = live_weights_digest(model)
    source = weights_dir or Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if not str(source) or not source.is_dir():
        raise UsageError("the tokenizer was not loaded from a local directory, so its files "
                         "cannot be hashed",
                         hint="load it with from_pretrained(<model directory>)")
    identity = ModelIdentity(architecture_digest(config), tokenizer_digest(source), weights)
    name = str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", ""))
    return Fingerprint(identity, config, name, _tokenizer_summary(tokenizer),
                       legacy_tokenizer_digest(tokenizer))


def dir_dtype(config: Any) -> str:
    """The dtype a model directory loads as by default (its config's dtype, else F32)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is None or str(dtype) == "auto":
        return "F32"
    return torch_dtype_name(dtype if "." in str(dtype) else f"torch.{dtype}")


def fingerprint_dir(path: Path | str, *, dtype: str | None = None,
                    cache_dir: Path | None = None) -> Fingerprint:
    """The identity of the model stored in a Hugging Face model directory, without loading
    its weights. `dtype` (a safetensors name) is the dtype it will run in; by default the
    one its config names."""
    model_dir = Path(path)
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"not a model directory (no config.json): {model_dir}")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise MissingExtra("fingerprinting a model directory", "hf") from None
    config = AutoConfig.from_pretrained(model_dir)
    kv = kv_config(config, dtype or dir_dtype(config))
    name = str(getattr(config, "_name_or_path", "") or model_dir.name)
    weights = dir_weights_digest(model_dir, cache_dir)
    identity = ModelIdentity(architecture_digest(kv), tokenizer_digest(model_dir), weights)
    return Fingerprint(identity, kv, name, _dir_tokenizer_summary(model_dir))

"""Synthetic KV files with the shape and statistics of real caches, for tests, demos and
benchmarks when no model is at hand (real captures come from integrations/transformers).
It lives beside the tests, not in the installed package: nothing a user runs needs it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvgraft.digest import Digest
from kvgraft.formats.kvfile import RawTensor, write_kvfile
from kvgraft.identity.model import ModelIdentity

if TYPE_CHECKING:
    from kvgraft.client import Registry

DTYPES = ("BF16", "F16", "F32")


def synthetic_identity(name: str = "synthetic") -> ModelIdentity:
    return ModelIdentity(Digest.of(b"architecture:" + name.encode()),
                         Digest.of(b"tokenizer:" + name.encode()),
                         Digest.of(b"weights:" + name.encode()))


def to_dtype(x: np.ndarray, dtype: str) -> bytes:
    """Row-major bytes of float32 `x` in a safetensors float dtype (BF16 rounds to nearest even)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "F32":
        return x.tobytes()
    if dtype == "F16":
        return x.astype(np.float16).tobytes()
    if dtype == "BF16":
        bits = x.view(np.uint32)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        return (rounded >> 16).astype(np.uint16).tobytes()
    raise ValueError(f"unsupported synthetic dtype {dtype}")


def synthetic_layers(num_layers: int, kv_heads: int, head_dim: int, tokens: int, *,
                     dtype: str = "BF16", window: int | None = None,
                     sliding: Sequence[int] = (), seed: int = 0,
                     ) -> list[tuple[RawTensor, RawTensor, int]]:
    """Per-channel scaled Gaussian K/V; layers in `sliding` keep only the last `window`."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_layers):
        length = min(tokens, window) if (window and i in sliding) else tokens
        pair = []
        for kind in (0, 1):
            # Keys carry a few large-magnitude channels (RoPE pairs); values are plainer.
            scale = rng.lognormal(0.0, 0.8 if kind == 0 else 0.3, (kv_heads, 1, head_dim))
            bias = rng.normal(0.0, 0.5 if kind == 0 else 0.05, (kv_heads, 1, head_dim))
            x = (rng.standard_normal((kv_heads, length, head_dim), dtype=np.float32)
                 * scale + bias)
            pair.append(RawTensor(dtype, (kv_heads, length, head_dim), to_dtype(x, dtype)))
        out.append((pair[0], pair[1], tokens - length))
    return out


def write_synthetic(path: Path | str, *, num_layers: int = 4, kv_heads: int = 2,
                    head_dim: int = 16, tokens: int = 600, dtype: str = "BF16",
                    window: int | None = None, sliding: Sequence[int] = (), seed: int = 0,
                    token_ids: Sequence[int] | None = None, name: str = "synthetic") -> Path:
    ids = list(token_ids) if token_ids is not None else [
        int(t) for t in np.random.default_rng(seed + 1).integers(0, 49152, tokens)]
    layers = synthetic_layers(num_layers, kv_heads, head_dim, len(ids), dtype=dtype,
                              window=window, sliding=sliding, seed=seed)
    # The recorded engine name is part of the bytes of committed fixtures (tests/data):
    # it stays as first written.
    return write_kvfile(path, layers, ids, synthetic_identity(name), model_name=name,
                        model_config={"model_type": name, "num_hidden_layers": num_layers,
                                      "num_key_value_heads": kv_heads, "head_dim": head_dim},
                        provenance={"engine": {"name": "kvgraft.sample"}, "seed": seed})


def variant(path: Path, run: int, *, seed: int = 0, tokens: int = 600) -> Path:
    """KV files of one seed differ only in their provenance (so in their header blob):
    they share every chunk blob and the token blob."""
    layers = synthetic_layers(2, 2, 16, tokens, seed=seed)
    ids = [(seed * 7919 + i * 31) % 49152 for i in range(tokens)]
    return write_kvfile(path, layers, ids, synthetic_identity(), model_name="synthetic",
                        model_config={"model_type": "synthetic"}, provenance={"run": run})


def stored(r: Registry) -> set[Digest]:
    """Every blob in the registry's store."""
    return {b.digest for b in r.store.iter()}

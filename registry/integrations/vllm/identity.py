"""The identity of the model a live vLLM engine serves, and the KV layout it serves it in.

The model part is computed from vLLM's model directory with the same fingerprint code as
the transformers integration (`fingerprint_dir`), so the two agree on architecture,
tokenizer and weights. The engine part (vLLM and torch versions, attention backend, device,
block size, KV dtype, tensor-parallel size) is folded into the architecture digest: KV
computed by one engine is not byte-exact in another, so an engine's prefix lookups (whose
keys are seeded by the identity) only ever find grafts that engine can restore exactly.
`plain` is the identity without the engine, the one transformers grafts of the same model
carry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.errors import UsageError
from kvgraft.identity.fingerprint import architecture_digest, fingerprint_dir
from kvgraft.identity.model import ModelIdentity

# vLLM dtype names -> safetensors names (the KV file's dtype vocabulary)
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "half": "F16",
           "float": "F32"}


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    identity: ModelIdentity  # the model as this engine serves it (engine folded in)
    plain: ModelIdentity  # the same model without the engine (transformers grafts)
    config: dict[str, Any]  # what the architecture digest covers, engine included
    name: str
    engine: dict[str, Any]
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str  # safetensors name
    block_size: int


def _dtype_name(dtype: Any) -> str:
    text = str(dtype).removeprefix("torch.")
    if text not in _DTYPES:
        raise UsageError(f"KV dtype {dtype} is not supported by the kvgraft connector")
    return _DTYPES[text]


MAX_STAGES = 8  # the pipeline sizes a cross-layout restore looks at: 1 to this


def tensor_parallel_size(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1))


def pipeline_parallel_size(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))


def check_served(vllm_config: Any) -> None:
    """Refuse, at construction and so on both sides alike, an engine whose KV the worker
    side cannot read or write: tensor parallelism that replicates KV heads (more ranks than
    heads, or heads that do not divide), or a kernel family whose paged layout the copies do
    not implement. The scheduler side never promises a load the worker side would then
    fail."""
    from kvgraft.integrations.vllm.paged import KNOWN_ISAS, attention_isa

    tp = tensor_parallel_size(vllm_config)
    heads = int(vllm_config.model_config.get_total_num_kv_heads())
    if tp < 1 or heads % tp:
        raise UsageError(f"tensor_parallel_size {tp} does not divide the model's {heads} KV "
                         "heads (vLLM replicates heads then; the connector moves each rank's "
                         "own slice)")
    model = vllm_config.model_config
    isa = attention_isa(model.dtype, int(vllm_config.cache_config.block_size),
                        int(model.get_head_size()))
    if isa not in KNOWN_ISAS:
        raise UsageError(f"the {isa!r} paged layout of vLLM's CPU attention is not "
                         f"supported (only {', '.join(KNOWN_ISAS)})")


def engine_info(vllm_config: Any, backend: str) -> dict[str, Any]:
    import torch
    import vllm
    from vllm.platforms import current_platform

    from kvgraft.integrations.vllm.paged import attention_isa

    cache = vllm_config.cache_config
    model = vllm_config.model_config
    # the kernels' ISA decides the KV's bytes (and the paged key layout the copies convert)
    isa = attention_isa(model.dtype, int(cache.block_size), int(model.get_head_size()))
    info = {"name": "vllm", "version": str(vllm.__version__), "torch": str(torch.__version__),
            "attention_backend": backend, "attention_isa": isa,
            "device": str(current_platform.device_type),
            "block_size": int(cache.block_size), "cache_dtype": str(cache.cache_dtype)}
    # Each rank computes its heads with a slice of the weights, so KV computed at one
    # tensor-parallel size need not be byte-exact at another; nor at another pipeline size
    # (measured: a two-stage graft restored without stages moves logprobs by ~1e-4).
    # Absent at 1, so the grafts of engines without parallelism keep their identity.
    return {**info, **_parallel(tensor_parallel_size(vllm_config),
                                pipeline_parallel_size(vllm_config))}


def _parallel(tensor: int, pipeline: int) -> dict[str, int]:
    sizes = {"tensor_parallel_size": tensor, "pipeline_parallel_size": pipeline}
    return {k: n for k, n in sizes.items() if n != 1}


def at_layout(ident: EngineIdentity, tensor: int, pipeline: int) -> EngineIdentity:
    """`ident` as the same engine would have it at other parallel sizes: the identity a
    graft published at those sizes carries (its request key kept)."""
    engine = {k: v for k, v in ident.engine.items()
              if k not in ("tensor_parallel_size", "pipeline_parallel_size")}
    engine.update(_parallel(tensor, pipeline))
    config = {**ident.config, "engine": engine}
    return dataclasses.replace(
        ident, config=config, engine=engine,
        identity=ModelIdentity(architecture_digest(config), ident.identity.tokenizer,
                               ident.identity.weights))


def other_layouts(ident: EngineIdentity) -> list[EngineIdentity]:
    """`ident` at every other layout: each tensor-parallel size the model's KV heads allow
    at each pipeline size up to `MAX_STAGES` (or the layers), fewest stages then smallest
    size first: the grafts a cross-layout restore may take. Each holds all heads and all
    layers, so any of them fits this engine's ranks and stages; its bytes are another
    layout's computation. One catalog lookup per layout on every miss, hence the bound."""
    own = (int(ident.engine.get("tensor_parallel_size", 1)),
           int(ident.engine.get("pipeline_parallel_size", 1)))
    return [at_layout(ident, n, p) for p in range(1, min(MAX_STAGES, ident.layers) + 1)
            for n in range(1, ident.kv_heads + 1)
            if ident.kv_heads % n == 0 and (n, p) != own]


def model_dir(vllm_config: Any) -> Path:
    """The local directory vLLM loaded the model from."""
    path = Path(str(vllm_config.model_config.model))
    if path.is_dir():
        return path
    try:  # a Hub id: the snapshot vLLM downloaded
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(vllm_config.model_config.model),
                                      revision=vllm_config.model_config.revision,
                                      local_files_only=True))
    except Exception as e:
        raise UsageError(f"cannot find the model directory of {path}: {e}") from None


def engine_identity(vllm_config: Any, *, backend: str, cache_dir: Path | None) -> EngineIdentity:
    kv_dtype = _dtype_name(vllm_config.model_config.dtype)
    if str(vllm_config.cache_config.cache_dtype) not in ("auto", str(
            vllm_config.model_config.dtype).removeprefix("torch.")):
        raise UsageError("a quantised KV cache (kv_cache_dtype) is not supported")
    fp = fingerprint_dir(model_dir(vllm_config), dtype=kv_dtype, cache_dir=cache_dir)
    kinds = set(fp.config.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise UsageError(f"only full-attention models are supported, not {sorted(kinds)}")
    engine = engine_info(vllm_config, backend)
    config = {**fp.config, "engine": engine}
    identity = ModelIdentity(architecture_digest(config), fp.identity.tokenizer,
                             fp.identity.weights)
    return EngineIdentity(identity, fp.identity, config, fp.name, engine,
                          int(fp.config["num_hidden_layers"]),
                          int(fp.config["num_key_value_heads"]), int(fp.config["head_dim"]),
                          kv_dtype, int(vllm_config.cache_config.block_size))

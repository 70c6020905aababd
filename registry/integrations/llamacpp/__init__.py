"""Grafting into llama.cpp through llama-cpp-python (needs the [llamacpp] extra).

    lm = load_model("model.gguf", cache_dir=registry.config.cache_dir)
    cap = capture(lm, "prefix.kv", text=document)      # prefill once, write a KV file
    registry.push(cap.path, "docs/manual:v1")
    result, lm = graft_generate(registry, lm, "docs/manual:v1", prompt=document + question)
    verify_graft(registry, lm, "docs/manual:v1", recompute=True)   # byte-exact, attested

The identity comes from the GGUF file plus the engine settings that decide the KV's bytes;
the graft is stored in kvgraft's KV file format (per layer [kv_heads, T, head_dim]), so it
is chunked, deduplicated and prefix-indexed like every other graft. See docs/llamacpp.md.
"""

from __future__ import annotations

try:
    import llama_cpp  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    from kvgraft.errors import MissingExtra

    raise MissingExtra("grafting into llama.cpp", "llamacpp") from e

from kvgraft.integrations.fidelity import FidelityReport
from kvgraft.integrations.llamacpp.engine import LlamaModel, Settings, load_model
from kvgraft.integrations.llamacpp.fidelity import verify_graft
from kvgraft.integrations.llamacpp.graft import (
    Capture,
    GraftResult,
    LlamaGraft,
    capture,
    graft_generate,
    load_graft,
)

__all__ = [
    "Capture",
    "FidelityReport",
    "GraftResult",
    "LlamaGraft",
    "LlamaModel",
    "Settings",
    "capture",
    "graft_generate",
    "load_graft",
    "load_model",
    "verify_graft",
]

"""Grafting into Hugging Face transformers (needs the [hf] extra: torch + transformers).

    lm = load_model("path/to/model", cache_dir=registry.config.cache_dir)
    capture(lm, "prefix.kv", text=document)               # prefill once, write a KV file
    registry.push("prefix.kv", "docs/manual:v1")
    graft = load_graft("docs/manual:v1", lm, registry=registry)   # refuses other models
    graft_generate(registry, lm, "docs/manual:v1", prompt=document + question)
    verify_graft(registry, lm, "docs/manual:v1")           # byte-identical, attested

Supported: causal LMs whose transformers cache is made of full-attention and
sliding-window layers (Llama, Mistral, Qwen2/3, Gemma 2/3, SmolLM, ...), transformers 5.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    from kvgraft.errors import MissingExtra

    raise MissingExtra("grafting into transformers", "hf") from e

from kvgraft.integrations.fidelity import FidelityReport
from kvgraft.integrations.transformers.capture import Capture, capture, chat_tokens, tokenize
from kvgraft.integrations.transformers.fidelity import FIDELITY_PREDICATE, verify_graft
from kvgraft.integrations.transformers.generate import GraftResult, graft_generate
from kvgraft.integrations.transformers.loader import Graft, load_graft
from kvgraft.integrations.transformers.models import (
    LoadedModel,
    load_model,
    set_threads,
    smollm2_dir,
)

__all__ = [
    "FIDELITY_PREDICATE",
    "Capture",
    "FidelityReport",
    "Graft",
    "GraftResult",
    "LoadedModel",
    "capture",
    "chat_tokens",
    "graft_generate",
    "load_graft",
    "load_model",
    "set_threads",
    "smollm2_dir",
    "tokenize",
    "verify_graft",
]

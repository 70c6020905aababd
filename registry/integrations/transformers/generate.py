"""Grafted generation: restore the longest usable prefix of a graft, feed only the rest of
the prompt, then decode greedily."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import UsageError
from kvgraft.integrations.transformers.capture import tokenize
from kvgraft.integrations.transformers.loader import Graft, common_prefix, load_graft
from kvgraft.integrations.transformers.models import LoadedModel, run
from kvgraft.reference import Reference


@dataclass(frozen=True, slots=True)
class Step:
    """Logits of one forward (one row per fed position) and the greedy choice after it."""

    logits: Any  # [positions, vocab]
    token: int


def forward(lm: LoadedModel, cache: Any, ids: Sequence[int]) -> Any:
    """Logits [len(ids), vocab] of feeding `ids` after what `cache` holds (cache grows)."""
    x = torch.tensor([list(ids)], dtype=torch.long, device=lm.device)
    return run(lm, x, cache).logits[0]


def greedy(lm: LoadedModel, cache: Any, feed: Sequence[int], steps: int, *,
           stop: set[int] | None = None) -> list[Step]:
    """Feed `feed`, then `steps` greedy tokens one at a time; one Step per forward."""
    if not feed:
        raise UsageError("nothing to feed the model: the prompt adds no tokens")
    out: list[Step] = []
    logits = forward(lm, cache, feed)
    for i in range(steps + 1):
        token = int(torch.argmax(logits[-1]).item())
        out.append(Step(logits, token))
        if i == steps or (stop and token in stop):
            break
        logits = forward(lm, cache, [token])
    return out


@dataclass(frozen=True, slots=True)
class GraftResult:
    digest: Digest
    prompt_tokens: int
    graft_tokens: int
    reused: int  # prompt tokens whose prefill the graft replaced
    tokens: tuple[int, ...]  # generated
    text: str
    load_seconds: float
    generate_seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"digest": str(self.digest), "prompt_tokens": self.prompt_tokens,
                "graft_tokens": self.graft_tokens, "reused_tokens": self.reused,
                "computed_tokens": self.prompt_tokens - self.reused,
                "generated": list(self.tokens), "text": self.text,
                "load_seconds": round(self.load_seconds, 6),
                "generate_seconds": round(self.generate_seconds, 6)}


def plan_reuse(graft: Graft, prompt: Sequence[int]) -> int:
    """How many prompt tokens to take from the graft: the longest common prefix, less one
    when the whole prompt is covered (the model needs at least one token to produce the
    next-token logits), cut back to what the sliding-window layers can restore."""
    shared = common_prefix(graft.token_ids, prompt)
    if shared == len(prompt):
        shared -= 1
    return graft.usable_length(shared) if shared > 0 else 0


def graft_generate(registry: Registry, lm: LoadedModel, ref: Reference | str, *,
                   prompt: str | None = None, prompt_ids: Sequence[int] | None = None,
                   max_new_tokens: int = 32, force_incompatible: bool = False,
                   require_signed_by: Sequence[str] = (),
                   require_verified: bool = False) -> GraftResult:
    """Generate from `prompt` (text or token ids) with the prefill of its common prefix
    with the graft `ref` restored instead of computed."""
    if (prompt is None) == (prompt_ids is None):
        raise UsageError("graft_generate takes a prompt or prompt ids (exactly one)")
    if max_new_tokens < 1:
        raise UsageError("max_new_tokens must be at least 1")
    t0 = time.perf_counter()
    graft = load_graft(ref, lm, registry=registry, force_incompatible=force_incompatible,
                       require_signed_by=require_signed_by, require_verified=require_verified)
    ids = (tokenize(lm.tokenizer, prompt) if prompt is not None
           else [int(t) for t in prompt_ids or []])
    if not ids:
        raise UsageError("the prompt has no tokens")
    reused = plan_reuse(graft, ids)
    cache = graft.cache(reused) if reused else DynamicCache(config=lm.model.config)
    t1 = time.perf_counter()
    eos = lm.tokenizer.eos_token_id
    stop = {int(eos)} if isinstance(eos, int) else set()
    steps = greedy(lm, cache, ids[reused:], max_new_tokens - 1, stop=stop)
    tokens = tuple(s.token for s in steps)
    text = str(lm.tokenizer.decode(list(tokens), skip_special_tokens=True))
    return GraftResult(graft.digest, len(ids), graft.token_count, reused, tokens, text,
                       t1 - t0, time.perf_counter() - t1)

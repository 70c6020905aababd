"""Capture: run the prefill of a token prefix and write its KV cache as a KV file.

Sliding-window layers are captured with one position more than transformers keeps
(the last `window` positions, not `window - 1`), so a graft can be cut back by at least
one token, which is what generating from a prompt equal to the graft needs; the loader
keeps exactly what the engine would have kept.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvgraft import __version__
from kvgraft.digest import Digest
from kvgraft.errors import UsageError
from kvgraft.formats.kvfile import RawTensor, write_kvfile
from kvgraft.identity.fingerprint import torch_dtype_name
from kvgraft.integrations.transformers.models import LoadedModel, engine_info, run


@dataclass(frozen=True, slots=True)
class Capture:
    path: Path
    token_count: int
    next_token: int
    logits_digest: Digest
    seconds: float


def raw_bytes(t: Any) -> memoryview:
    """The row-major bytes of a tensor (on the CPU), without a dtype conversion."""
    flat = t.detach().contiguous().cpu().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def tokenize(tokenizer: Any, text: str, *, special: bool = True) -> list[int]:
    ids = tokenizer(text, add_special_tokens=special)["input_ids"]
    return [int(i) for i in ids]


def chat_tokens(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("this tokenizer has no chat template; use --text instead")
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    return tokenize(tokenizer, str(text), special=False)


def prefill(lm: LoadedModel, token_ids: Sequence[int], *, record_past: bool = False,
            ) -> tuple[Any, Any]:
    """(cache, logits of the last position) after one forward over `token_ids`."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=lm.device)
    cache = DynamicCache(config=lm.model.config)
    if record_past:
        layers: list[Any] = list(cache.layers)
        for layer in layers:
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()  # type: ignore[no-untyped-call]
    out = run(lm, ids, cache)
    return cache, out.logits[0, -1]


def cache_tensors(cache: Any, n: int) -> list[tuple[Any, Any, int]]:
    """(key [H, T, D], value, start) per layer, as the KV file stores them."""
    out = []
    for i, layer in enumerate(cache.layers):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise UsageError(f"layer {i} uses a {type(layer).__name__} cache, which kvgraft "
                             "cannot capture (full and sliding-window attention only)")
        k, v = layer.keys[0], layer.values[0]
        if isinstance(layer, DynamicSlidingWindowLayer):
            keep = min(n, layer.sliding_window)
            k, v = k[:, -keep:], v[:, -keep:]
        out.append((k, v, n - k.shape[1]))
    return out


def capture(lm: LoadedModel, output: Path | str, *, token_ids: Sequence[int] | None = None,
            text: str | None = None) -> Capture:
    """Prefill `token_ids` (or the tokens of `text`) and write the KV file `output`."""
    if (token_ids is None) == (text is None):
        raise UsageError("capture takes token ids or text (exactly one)")
    ids = tokenize(lm.tokenizer, text) if text is not None else [int(t) for t in token_ids or []]
    if not ids:
        raise UsageError("nothing to capture: the prefix has no tokens")
    t0 = datetime.now(UTC)
    cache, logits = prefill(lm, ids, record_past=True)
    seconds = (datetime.now(UTC) - t0).total_seconds()
    layers = []
    tensor_digests: dict[str, str] = {}
    for i, (k, v, start) in enumerate(cache_tensors(cache, len(ids))):
        dtype = torch_dtype_name(k.dtype)
        kb, vb = raw_bytes(k), raw_bytes(v)
        tensor_digests[f"layers.{i}.key"] = str(Digest.of(kb))
        tensor_digests[f"layers.{i}.value"] = str(Digest.of(vb))
        layers.append((RawTensor(dtype, tuple(k.shape), kb), RawTensor(dtype, tuple(v.shape), vb),
                       start))
    logit_bytes = raw_bytes(logits)
    logits_digest = Digest.of(logit_bytes)
    next_token = int(torch.argmax(logits).item())
    token_bytes = torch.tensor(ids, dtype=torch.int64).numpy().tobytes()
    tensor_digests["token_ids"] = str(Digest.of(token_bytes))
    fp = lm.fingerprint
    provenance = {
        "created": t0.isoformat(),
        "creator": f"{_user()}@{socket.gethostname()}",
        "kvgraft": __version__,
        "engine": engine_info(lm.model),
        "input": {"token_ids": str(Digest.of(token_bytes)), "token_count": len(ids),
                  "text": str(Digest.of(text.encode())) if text is not None else None},
        "output": {"tensors": tensor_digests,
                   "next_token": {"logits": str(logits_digest),
                                  "logits_dtype": torch_dtype_name(logits.dtype),
                                  "argmax": next_token},
                   "prefill_seconds": round(seconds, 6)},
        "parents": [],
    }
    path = write_kvfile(output, layers, token_bytes, fp.identity, model_name=fp.name,
                        model_config=fp.config, provenance=provenance)
    return Capture(path, len(ids), next_token, logits_digest, seconds)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"

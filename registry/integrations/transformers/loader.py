"""The compatibility-checking loader: pull a graft through the machine cache, check it
belongs to the live model, and rebuild a transformers cache from it.

The rebuilt cache is what the engine would hold after the same prefill: full-attention
layers get every position, sliding-window layers the last `window - 1` positions and
their `cumulative_length` counter (without it the next forward masks and positions the
window wrongly and runs silently wrong). Tensors stay in the graft's dtype on the model's
device; a dtype that differs from the model's is refused, never cast.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import IncompatibleModel
from kvgraft.formats.kvfile import KVLayout, TensorInfo
from kvgraft.formats.manifest import Manifest
from kvgraft.identity.compat import CompatReport
from kvgraft.identity.fingerprint import torch_dtype_name
from kvgraft.integrations.transformers.device import to_device
from kvgraft.integrations.transformers.models import LoadedModel
from kvgraft.reference import Reference
from kvgraft.services.compat import admit
from kvgraft.transfer.materialise import KVBuffer, read_kv

log = logging.getLogger(__name__)
_TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                 "F64": torch.float64}


@dataclass(frozen=True, slots=True)
class GraftLayer:
    key: Any  # [1, kv_heads, T, head_dim] on the model's device
    value: Any
    start: int  # absolute position of key[:, :, 0]


@dataclass(frozen=True, slots=True)
class Graft:
    """A verified graft, ready to be turned into caches for the model it was checked against."""

    reference: Reference
    digest: Digest
    manifest: Manifest
    token_ids: tuple[int, ...]
    layers: tuple[GraftLayer, ...]
    report: CompatReport
    config: Any  # the live model's config (decides the cache layer kinds)

    @property
    def token_count(self) -> int:
        return len(self.token_ids)

    def _kinds(self) -> list[Any]:
        return list(DynamicCache(config=self.config).layers)

    def usable_length(self, length: int) -> int:
        """The longest prefix ≤ `length` this graft can restore. Full-attention layers can
        be cut anywhere; a sliding-window layer needs the window before the cut, which it
        holds only near the end of the graft (or everywhere, for grafts shorter than it)."""
        best = min(length, self.token_count)
        for kind, layer in zip(self._kinds(), self.layers, strict=True):
            if isinstance(kind, DynamicSlidingWindowLayer):
                w = kind.sliding_window - 1
                if best - min(best, w) < layer.start:
                    best = min(best, w) if layer.start == 0 else 0
            elif layer.start != 0:
                best = 0
        return best

    def cache(self, length: int | None = None) -> Any:
        """A fresh DynamicCache over the first `length` tokens (all by default). The tensors
        are shared, not copied: the cache grows by concatenation, never in place."""
        n = self.token_count if length is None else length
        if not 0 < n <= self.token_count or self.usable_length(n) != n:
            raise IncompatibleModel(f"graft {self.reference} cannot be restored at {n} tokens "
                                    "(its sliding-window layers do not hold that window)")
        cache = DynamicCache(config=self.config)
        kinds: list[Any] = list(cache.layers)
        for i, (kind, layer) in enumerate(zip(kinds, self.layers, strict=True)):
            sliding = type(kind) is DynamicSlidingWindowLayer
            if not sliding and type(kind) is not DynamicLayer:
                raise IncompatibleModel(f"layer {i} of this model uses a "
                                        f"{type(kind).__name__} cache, which kvgraft cannot fill")
            lo = n - min(n, kind.sliding_window - 1) if sliding else 0
            k = layer.key[:, :, lo - layer.start : n - layer.start]
            v = layer.value[:, :, lo - layer.start : n - layer.start]
            kind.lazy_initialization(k, v)
            kind.keys, kind.values = k, v
            if sliding:
                kind.cumulative_length = n  # positions and the window mask derive from it
        return cache


def _check_structure(layout: KVLayout, lm: LoadedModel, what: str) -> None:
    """What a forced load still cannot do: fill a cache of another shape or dtype."""
    kinds = list(DynamicCache(config=lm.model.config).layers)
    want = torch_dtype_name(lm.dtype)
    if len(kinds) != len(layout.layers):
        raise IncompatibleModel(f"{what} has {len(layout.layers)} layers, the model "
                                f"{len(kinds)}: it cannot be loaded even when forced")
    probe = lm.model.config.get_text_config(decoder=True)
    heads = getattr(probe, "num_key_value_heads", None) or probe.num_attention_heads
    dim = getattr(probe, "head_dim", None) or probe.hidden_size // probe.num_attention_heads
    for layer in layout.layers:
        if layer.key.dtype != want:
            raise IncompatibleModel(f"{what} holds {layer.key.dtype} tensors, the model runs in "
                                    f"{want}: kvgraft does not cast a cache")
        if layer.key.shape[0] != heads or layer.key.shape[2] != dim:
            raise IncompatibleModel(f"{what} layer {layer.index} is [{layer.key.shape[0]} heads, "
                                    f"{layer.key.shape[2]} dims], the model needs [{heads}, {dim}]")


def _tensors(buf: KVBuffer, base: int, tensors: Sequence[TensorInfo], device: Any,
             ) -> list[Any]:
    """The tensors [1, *shape] on `device`. On the CPU they are views of the verified
    buffer (no copy); elsewhere copies made through pinned staging buffers (device.py)."""
    if torch.device(device).type == "cpu":
        return [torch.frombuffer(buf, dtype=_TORCH_DTYPES[t.dtype], count=t.nbytes // t.itemsize,
                                 offset=base + t.begin).view(1, *t.shape) for t in tensors]
    flats = to_device(buf, [(base + t.begin, t.nbytes) for t in tensors], device)
    return [f.view(_TORCH_DTYPES[t.dtype]).view(1, *t.shape)
            for f, t in zip(flats, tensors, strict=True)]


def load_graft(ref: Reference | str, lm: LoadedModel, *, registry: Registry,
               force_incompatible: bool = False, require_signed_by: Sequence[str] = (),
               require_verified: bool = False, for_verification: bool = False,
               workers: int = 2) -> Graft:
    """Open `ref` through `Registry.open` (the policy of config.toml plus
    `require_signed_by` and `require_verified`, the latter for `lm`), refuse it unless it
    belongs to `lm`, and return it ready to restore, read through the machine cache. With
    `force_incompatible` a mismatch is logged as a warning and recorded in the audit log
    (action "force-incompatible") instead of refused. `for_verification` is for the
    fidelity check itself, which require_verified cannot apply to."""
    reference = Reference.parse(ref) if isinstance(ref, str) else ref
    opened = registry.open(reference, require_signed_by=require_signed_by,
                           require_verified=require_verified, model=lm.fingerprint.identity,
                           for_verification=for_verification, action="load")
    digest, manifest = opened.digest, opened.manifest
    what = f"graft {reference}"
    report = admit(registry.events, reference, digest, manifest, lm.fingerprint,
                   force_incompatible=force_incompatible, log=log)
    layout, buf, base = read_kv(manifest, opened.fetcher, workers=workers)
    _check_structure(layout, lm, what)
    if not registry.config.offline and reference.tag is not None:
        registry.cache.put_ref(reference, digest)
    flat = _tensors(buf, base, [t for li in layout.layers for t in (li.key, li.value)],
                    lm.device)
    layers = tuple(GraftLayer(flat[2 * i], flat[2 * i + 1], li.start)
                   for i, li in enumerate(layout.layers))
    tokens = tuple(torch.frombuffer(buf, dtype=torch.int64, count=layout.token_count,
                                    offset=base + layout.token_ids.begin).tolist())
    return Graft(reference, digest, manifest, tokens, layers, report, lm.model.config)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

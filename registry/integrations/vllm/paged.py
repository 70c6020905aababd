"""Moving KV between vLLM's paged CPU cache and the [kv_heads, tokens, head_dim] tensors of
a KV file.

vLLM's CPU attention backend keeps one tensor per layer, [blocks, kv_heads, block_size, X],
which it views as [blocks, kv_heads, 2 * block_size, head_dim]: within a block and a head,
`block_size` rows of keys, then `block_size` rows of values. Its kernels (the "ISA" vLLM
picks from the CPU, dtype, block size and head size) choose how those bytes are laid out:

- "vec" (x86 AVX2/AVX-512 without AMX): keys transposed, [head_dim, block_size]; values
  as they are, [block_size, head_dim] (measured: a transformers prefill's keys equal the
  block's key bytes read that way, to bf16 rounding).
- "amx" (x86 with AMX tiles, bf16, block size a multiple of 32): keys in groups of 16
  tokens, each group [head_dim / 2, 16 tokens, 2 dims]; values in groups of 16 dims, each
  group [block_size / 2, 16 dims, 2 tokens] (the B-matrix packing of AMX tiles, as
  vLLM's `reshape_and_cache` for AMX writes it).

The copies here convert to and from the KV file's [kv_heads, tokens, head_dim], so a graft
holds the same layout whichever engine made it; a layout not known here is refused.
Every span moved here starts and ends on a block boundary, so a span is a set of whole
blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgraft.errors import UsageError

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


KNOWN_ISAS = ("vec", "amx")  # layouts the copies below implement


@functools.cache
def attention_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The kernel family vLLM's CPU attention uses for this cache (it decides the layout)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_dim))


@dataclass(frozen=True, slots=True)
class PagedLayer:
    """One layer's paged cache as [blocks, kv_heads, 2 * block_size, head_dim], and the
    kernel family whose layout its bytes are in."""

    view: torch.Tensor
    isa: str
    block_size: int

    def _block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of `block` as strided views; a file's [kv_heads, block_size,
        head_dim] viewed as their shape (`_as`) pairs with them element for element. AMX
        keys are moved as int32, a pair of dims at a time (3x faster than bf16 pairs)."""
        heads, dim, bs = self.view.shape[1], self.view.shape[3], self.block_size
        raw = self.view[block]
        if self.isa == "amx":
            key = raw[:, :bs].view(torch.int32).view(heads, bs // 16, dim // 2, 16)
            value = raw[:, bs:].view(heads, dim // 16, bs // 2, 16, 2)
            return key.transpose(2, 3), value.permute(0, 2, 4, 1, 3)
        return raw[:, :bs].view(heads, dim, bs).transpose(1, 2), raw[:, bs:]

    @staticmethod
    def _as(file_part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        t = file_part.view(torch.int32) if like.dtype == torch.int32 else file_part
        return t.view(like.shape)  # only splits dims: a view whatever the strides

    def write(self, block: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Copy a file's [kv_heads, block_size, head_dim] key and value into `block`."""
        k, v = self._block(block)
        k.copy_(self._as(key, k))
        src = self._as(value, v)
        if self.isa == "amx":
            # one copy per token of a pair: runs of 16 elements, not of 2 (1.25x faster)
            for p in range(2):
                v[:, :, p].copy_(src[:, :, p])
        else:
            v.copy_(src)

    def read(self, block: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Copy `block` into a file's [kv_heads, block_size, head_dim] key and value."""
        k, v = self._block(block)
        self._as(key, k).copy_(k)
        self._as(value, v).copy_(v)


def block_view(layer: torch.Tensor, kv_heads: int, block_size: int, head_dim: int,
               dtype: torch.dtype, isa: str | None = None) -> PagedLayer:
    """One layer's paged cache, its bytes laid out as `isa` (default: what vLLM chooses
    here for this dtype, block size and head dim) lays them out."""
    isa = isa or attention_isa(dtype, block_size, head_dim)
    if isa not in KNOWN_ISAS:
        raise UsageError(f"vLLM CPU attention kernels {isa!r} lay KV out in a way the "
                         f"kvgraft connector does not know (known: {', '.join(KNOWN_ISAS)})")
    t = layer if layer.dtype == dtype else layer.view(dtype)
    if t.dim() != 4 or t.shape[1] != kv_heads or t.shape[2] != block_size:
        raise UsageError(f"unexpected paged KV layout {tuple(layer.shape)} {layer.dtype} "
                         f"(kv heads {kv_heads}, block size {block_size})")
    view = t.view(t.shape[0], kv_heads, 2 * block_size, -1)
    if view.shape[3] != head_dim:
        raise UsageError(f"paged KV head dim {view.shape[3]} != model head dim {head_dim}")
    if isa == "amx" and (block_size % 32 or head_dim % 32 or view.element_size() != 2):
        raise UsageError(f"the AMX layout needs a 16-bit KV dtype, block size and head dim "
                         f"multiples of 32 (block {block_size}, head dim {head_dim})")
    return PagedLayer(view, isa, block_size)


def gather(layer: PagedLayer, blocks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, value), each [kv_heads, len(blocks) * block_size, head_dim], contiguous copies."""
    heads, dim, bs = layer.view.shape[1], layer.view.shape[3], layer.block_size
    key = torch.empty(heads, len(blocks) * bs, dim, dtype=layer.view.dtype)
    value = torch.empty_like(key)
    for j, b in enumerate(blocks):
        layer.read(b, key[:, j * bs : (j + 1) * bs], value[:, j * bs : (j + 1) * bs])
    return key, value


def scatter(layer: PagedLayer, blocks: Sequence[int], key: torch.Tensor,
            value: torch.Tensor) -> None:
    """Write key/value [kv_heads, len(blocks) * block_size, head_dim] into `blocks`.

    One copy per block: each is below torch's parallel grain size, so it runs on the calling
    thread. A single indexed copy of many blocks is split across torch's threads, which
    vLLM binds to the cores it computes on: measured 15x slower on 2 cores."""
    bs, tokens, n = layer.block_size, key.shape[1], len(blocks)
    if tokens != n * bs or value.shape != key.shape:
        raise UsageError(f"span of {tokens} tokens does not fill {n} blocks")
    for j, b in enumerate(blocks):
        layer.write(b, key[:, j * bs : (j + 1) * bs], value[:, j * bs : (j + 1) * bs])


def tensor_from(buf: Any, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
                ) -> torch.Tensor:
    count = 1
    for s in shape:
        count *= s
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)

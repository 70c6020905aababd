"""Moving KV between vLLM's paged CPU cache and the [kv_heads, tokens, head_dim] tensors of
a KV file.

vLLM's CPU attention backend keeps one tensor per layer, [blocks, kv_heads, block_size, X],
which it views as [blocks, kv_heads, 2 * block_size, head_dim]: within a block and a head,
the keys, then `block_size` value rows. Its kernels choose how keys are laid out (the
"ISA" vLLM picks from the dtype, block size and head size): with "vec" (x86 AVX2/AVX-512
without AMX) a block's keys are stored transposed, [head_dim, block_size] (measured: a
transformers prefill's keys equal the block's key bytes read that way, to bf16 rounding).
The copies here convert to and from the KV file's [kv_heads, tokens, head_dim], so a graft
holds the same layout whichever engine made it; a layout not known here is refused.
Every span moved here starts and ends on a block boundary, so a span is a set of whole
blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from kvgraft.errors import UsageError

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


KNOWN_ISAS = ("vec",)  # key layouts the copies below implement


@functools.cache
def attention_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The kernel family vLLM's CPU attention uses for this cache (it decides the layout)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_dim))


def block_view(layer: torch.Tensor, kv_heads: int, block_size: int, head_dim: int,
               dtype: torch.dtype, isa: str | None = None) -> torch.Tensor:
    """[blocks, kv_heads, 2 * block_size, head_dim] view of one layer's paged cache, whose
    keys are laid out as `isa` (default: what vLLM chooses here) lays them out."""
    isa = isa or attention_isa(dtype, block_size, head_dim)
    if isa not in KNOWN_ISAS:
        raise UsageError(f"vLLM CPU attention kernels {isa!r} lay keys out in a way the "
                         f"kvgraft connector does not know (known: {', '.join(KNOWN_ISAS)})")
    t = layer if layer.dtype == dtype else layer.view(dtype)
    if t.dim() != 4 or t.shape[1] != kv_heads or t.shape[2] != block_size:
        raise UsageError(f"unexpected paged KV layout {tuple(layer.shape)} {layer.dtype} "
                         f"(kv heads {kv_heads}, block size {block_size})")
    view = t.view(t.shape[0], kv_heads, 2 * block_size, -1)
    if view.shape[3] != head_dim:
        raise UsageError(f"paged KV head dim {view.shape[3]} != model head dim {head_dim}")
    return view


def gather(view: torch.Tensor, blocks: Sequence[int], block_size: int,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, value), each [kv_heads, len(blocks) * block_size, head_dim], contiguous copies."""
    heads, dim = view.shape[1], view.shape[3]
    key = torch.empty(heads, len(blocks) * block_size, dim, dtype=view.dtype)
    value = torch.empty_like(key)
    for j, b in enumerate(blocks):
        key[:, j * block_size : (j + 1) * block_size].copy_(_keys(view, b, block_size))
        value[:, j * block_size : (j + 1) * block_size].copy_(view[b, :, block_size:])
    return key, value


def _keys(view: torch.Tensor, block: int, block_size: int) -> torch.Tensor:
    """A block's keys as [kv_heads, block_size, head_dim] (a strided view of the
    [head_dim, block_size] bytes, copied in place by the callers)."""
    heads, dim = view.shape[1], view.shape[3]
    return view[block, :, :block_size].view(heads, dim, block_size).transpose(1, 2)


def scatter(view: torch.Tensor, blocks: Sequence[int], block_size: int, key: torch.Tensor,
            value: torch.Tensor) -> None:
    """Write key/value [kv_heads, len(blocks) * block_size, head_dim] into `blocks`.

    One copy per block: each is below torch's parallel grain size, so it runs on the calling
    thread. A single indexed copy of many blocks is split across torch's threads, which
    vLLM binds to the cores it computes on: measured 15x slower on 2 cores."""
    tokens, n = key.shape[1], len(blocks)
    if tokens != n * block_size or value.shape != key.shape:
        raise UsageError(f"span of {tokens} tokens does not fill {n} blocks")
    for j, b in enumerate(blocks):
        _keys(view, b, block_size).copy_(key[:, j * block_size : (j + 1) * block_size])
        view[b, :, block_size:].copy_(value[:, j * block_size : (j + 1) * block_size])


def tensor_from(buf: Any, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
                ) -> torch.Tensor:
    count = 1
    for s in shape:
        count *= s
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)

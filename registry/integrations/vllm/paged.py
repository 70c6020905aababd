"""Moving KV between vLLM's paged CPU cache and the [kv_heads, tokens, head_dim] tensors of
a KV file.

vLLM's CPU attention backend keeps one tensor per layer, [blocks, kv_heads, block_size, X],
which it views as [blocks, kv_heads, 2 * block_size, head_dim]: within a block and a head,
`block_size` key rows, then `block_size` value rows. Every span moved here starts and ends
on a block boundary, so a span is a set of whole blocks and one indexed copy per layer moves it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvgraft.errors import UsageError

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def block_view(layer: torch.Tensor, kv_heads: int, block_size: int, head_dim: int,
               dtype: torch.dtype) -> torch.Tensor:
    """[blocks, kv_heads, 2 * block_size, head_dim] view of one layer's paged cache."""
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
        key[:, j * block_size : (j + 1) * block_size].copy_(view[b, :, :block_size])
        value[:, j * block_size : (j + 1) * block_size].copy_(view[b, :, block_size:])
    return key, value


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
        view[b, :, :block_size].copy_(key[:, j * block_size : (j + 1) * block_size])
        view[b, :, block_size:].copy_(value[:, j * block_size : (j + 1) * block_size])


def tensor_from(buf: Any, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
                ) -> torch.Tensor:
    count = 1
    for s in shape:
        count *= s
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)

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
    idx = torch.tensor(list(blocks), dtype=torch.long)
    sel = view.index_select(0, idx)  # [n, H, 2B, D]
    heads, dim = sel.shape[1], sel.shape[3]
    key = sel[:, :, :block_size].permute(1, 0, 2, 3).reshape(heads, -1, dim)
    value = sel[:, :, block_size:].permute(1, 0, 2, 3).reshape(heads, -1, dim)
    return key.contiguous(), value.contiguous()


def scatter(view: torch.Tensor, blocks: Sequence[int], block_size: int, key: torch.Tensor,
            value: torch.Tensor) -> None:
    """Write key/value [kv_heads, len(blocks) * block_size, head_dim] into `blocks`."""
    heads, tokens, dim = key.shape
    n = len(blocks)
    if tokens != n * block_size or value.shape != key.shape:
        raise UsageError(f"span of {tokens} tokens does not fill {n} blocks")
    idx = torch.tensor(list(blocks), dtype=torch.long)
    # one indexed copy each for the key rows and the value rows of the blocks
    view[:, :, :block_size].index_copy_(
        0, idx, key.reshape(heads, n, block_size, dim).transpose(0, 1))
    view[:, :, block_size:].index_copy_(
        0, idx, value.reshape(heads, n, block_size, dim).transpose(0, 1))


def tensor_from(buf: Any, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
                ) -> torch.Tensor:
    count = 1
    for s in shape:
        count *= s
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)

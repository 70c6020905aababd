"""Moving KV between vLLM's paged CPU cache and the [kv_heads, tokens, head_dim] tensors of
a KV file.

vLLM's CPU attention backend keeps one tensor per layer, [blocks, kv_heads, block_size, X],
which it views as [blocks, kv_heads, 2 * block_size, head_dim]: within a block and a head,
`block_size` rows of keys, then `block_size` rows of values. Its kernels (the "ISA" vLLM
picks from the CPU, dtype, block size and head size) choose how those bytes are laid out:

- "vec" (x86 AVX2/AVX-512 without AMX): keys transposed, [head_dim, block_size]; values
  as they are, [block_size, head_dim] (measured: a transformers prefill's keys equal the
  block's key bytes read that way, to bf16 rounding).
- "vec16" (what vLLM picks for a head size that is a multiple of 16 but not of 32, such as
  80, whatever the CPU, and on x86 for a block size not a multiple of 32): the same bytes
  as "vec". Its kernels (`AttentionImpl<ISA::VEC16>`, vLLM's csrc/cpu/cpu_attn_vec16.hpp)
  derive from the "vec" ones and keep their `reshape_and_cache` (keys column-major, values
  row-major); they differ only in computing in tiles of 16 tokens and 16 dims (checked
  against vLLM's own `cpu_attn_reshape_and_cache` in tests/test_vllm.py).
- "amx" (x86 with AMX tiles, bf16, block size a multiple of 32): keys in groups of 16
  tokens, each group [head_dim / 2, 16 tokens, 2 dims]; values in groups of 16 dims, each
  group [block_size / 2, 16 dims, 2 tokens] (the B-matrix packing of AMX tiles, as
  vLLM's `reshape_and_cache` for AMX writes it).

The copies here convert to and from the KV file's [kv_heads, tokens, head_dim], so a graft
holds the same layout whichever engine made it; a layout not known here is refused.
Every span moved here starts and ends on a block boundary, so a span is a set of whole
blocks.

Each copy moves a whole run of consecutive blocks (usually all of a chunk's) of one layer
in one strided NumPy assignment over the raw bytes (as 16- or 32-bit integers: a copy
needs no float type). NumPy copies on the calling thread and releases the GIL: torch would
split a copy this large across its OpenMP threads, which vLLM binds to the cores it
computes on (measured 15x slower on 2 cores), and a copy per block costs more in Python
than in bytes (a 256-token chunk of SmolLM2-135M into 128-token blocks: 2.0 ms per block,
0.7 ms per run; `python -m benchmarks.vllm` reports the restore's MB/s).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvgraft.errors import UsageError

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_INTS = {2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}  # bytes moved as integers


KNOWN_ISAS = ("vec", "vec16", "amx")  # layouts the copies below implement


@functools.cache
def attention_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The kernel family vLLM's CPU attention uses for this cache (it decides the layout)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_dim))


def _ints(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A CPU tensor's bytes as a NumPy array of integers of its element size (no copy)."""
    return t.view(_INTS[t.element_size()][0]).numpy()


@dataclass(frozen=True, slots=True)
class PagedLayer:
    """One layer's paged cache: `keys` and `values`, [blocks, kv_heads, *block_shape] views
    of its bytes, where a file's [kv_heads, n * block_size, head_dim] seen through `_split`
    is [n, kv_heads, *block_shape] and pairs with n blocks element for element; `rows`, the
    same bytes as [blocks, kv_heads, 2 * block_size * head_dim], a block's bytes as vLLM's
    kernels read them whatever the layout."""

    rows: np.ndarray[Any, Any]
    keys: np.ndarray[Any, Any]
    values: np.ndarray[Any, Any]
    isa: str
    block_size: int
    head_dim: int
    dtype: torch.dtype

    def _split(self, part: np.ndarray[Any, Any], key: bool) -> np.ndarray[Any, Any]:
        bs, dim = self.block_size, self.head_dim
        heads, n = part.shape[0], part.shape[1] // bs
        if self.isa == "amx" and key:  # int32 pairs of dims, in groups of 16 tokens
            pairs = part.view(np.int32)  # a row of head dims is contiguous in a file
            return pairs.reshape(heads, n, bs // 16, 16, dim // 2).swapaxes(0, 1)
        if self.isa == "amx":  # pairs of tokens, in groups of 16 dims
            return part.reshape(heads, n, bs // 2, 2, dim // 16, 16).swapaxes(0, 1)
        return part.reshape(heads, n, bs, dim).swapaxes(0, 1)

    def write(self, blocks: Sequence[int], key: np.ndarray[Any, Any],
              value: np.ndarray[Any, Any]) -> None:
        """Copy a file's [kv_heads, len(blocks) * block_size, head_dim] key and value (as
        integers of the cache's element size) into `blocks`."""
        k, v = self._split(key, True), self._split(value, False)
        for j, first, n in _runs(blocks):
            self.keys[first : first + n] = k[j : j + n]
            if self.isa == "amx":
                # one copy per token of a pair: runs of 16 elements, not of 2 (3x faster)
                for p in range(2):
                    self.values[first : first + n, :, :, p] = v[j : j + n, :, :, p]
            else:
                self.values[first : first + n] = v[j : j + n]

    def read(self, blocks: Sequence[int], key: np.ndarray[Any, Any],
             value: np.ndarray[Any, Any]) -> None:
        """Copy `blocks` into a file's [kv_heads, len(blocks) * block_size, head_dim] key
        and value."""
        k, v = self._split(key, True), self._split(value, False)
        for j, first, n in _runs(blocks):
            k[j : j + n] = self.keys[first : first + n]
            v[j : j + n] = self.values[first : first + n]


Rows = tuple[np.ndarray[Any, Any], ...]  # some blocks' bytes, a contiguous array per layer


def take_rows(layers: Sequence[PagedLayer], blocks: Sequence[int]) -> Rows:
    """Copies of `blocks` of each layer, in the cache's own layout."""
    index = np.asarray(blocks)
    return tuple(layer.rows[index] for layer in layers)


def put_rows(layers: Sequence[PagedLayer], blocks: Sequence[int], rows: Rows,
             skip: int = 0) -> int:
    """Copy `rows` (from `take_rows`), less their first `skip` blocks, into `blocks`: a
    copy per run of consecutive blocks, no conversion; bytes written."""
    if len(rows) != len(layers) or any(len(r) < skip + len(blocks) for r in rows):
        raise UsageError(f"{len(rows)} layers of kept blocks do not cover {len(blocks)} "
                         f"blocks from block {skip} of {len(layers)} paged layers")
    written = 0
    for layer, src in zip(layers, rows, strict=True):
        for j, first, n in _runs(blocks):
            layer.rows[first : first + n] = src[skip + j : skip + j + n]
        written += src[0].nbytes * len(blocks)
    return written


def _runs(blocks: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(position in `blocks`, first block id, count) of each run of consecutive ids."""
    j = 0
    while j < len(blocks):
        n = 1
        while j + n < len(blocks) and blocks[j + n] == blocks[j] + n:
            n += 1
        yield j, blocks[j], n
        j += n


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
    if view.element_size() not in _INTS or not view.is_contiguous():
        raise UsageError(f"unexpected paged KV layout {tuple(layer.shape)} {layer.dtype}")
    nb, per = view.shape[0], block_size * head_dim  # elements of a block's keys (or values)
    raw = _ints(view).reshape(nb, kv_heads, 2 * per)
    keys, values = raw[:, :, :per], raw[:, :, per:]
    if isa == "amx":
        pairs = _ints(view.view(torch.int32)).reshape(nb, kv_heads, per)[:, :, : per // 2]
        k = pairs.reshape(nb, kv_heads, block_size // 16, head_dim // 2, 16).swapaxes(3, 4)
        v = values.reshape(nb, kv_heads, head_dim // 16, block_size // 2, 16, 2) \
            .transpose(0, 1, 3, 5, 2, 4)
    else:  # vec, vec16: keys transposed, [head_dim, block_size]; values as they are
        k = keys.reshape(nb, kv_heads, head_dim, block_size).swapaxes(2, 3)
        v = values.reshape(nb, kv_heads, block_size, head_dim)
    return PagedLayer(raw, k, v, isa, block_size, head_dim, dtype)


def gather(layer: PagedLayer, blocks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, value), each [kv_heads, len(blocks) * block_size, head_dim], contiguous copies."""
    key = torch.empty(layer.keys.shape[1], len(blocks) * layer.block_size, layer.head_dim,
                      dtype=layer.dtype)
    value = torch.empty_like(key)
    layer.read(blocks, _ints(key), _ints(value))
    return key, value


def scatter(layer: PagedLayer, blocks: Sequence[int], key: torch.Tensor | np.ndarray[Any, Any],
            value: torch.Tensor | np.ndarray[Any, Any]) -> None:
    """Write key/value [kv_heads, len(blocks) * block_size, head_dim] into `blocks`."""
    k = _ints(key) if isinstance(key, torch.Tensor) else key
    v = _ints(value) if isinstance(value, torch.Tensor) else value
    n = len(blocks)
    if k.shape[1] != n * layer.block_size or v.shape != k.shape:
        raise UsageError(f"span of {k.shape[1]} tokens does not fill {n} blocks")
    layer.write(blocks, k, v)


def array_from(buf: Any, offset: int, shape: tuple[int, ...], itemsize: int,
               ) -> np.ndarray[Any, Any]:
    """A tensor of a KV file's bytes as integers of `itemsize` bytes (no copy)."""
    count = 1
    for s in shape:
        count *= s
    return np.frombuffer(buf, dtype=_INTS[itemsize][1], count=count, offset=offset) \
        .reshape(shape)

"""The connector's worker side: restores the chunks the scheduler side planned into the
blocks vLLM allocated, and publishes the prompts the engine computed.

A restore reads each chunk back from memory or the machine cache (verified again on read)
and writes it into vLLM's paged blocks before the forward starts. Publishing (whole blocks)
copies the computed blocks out during the forward and stores them from a background
thread, off the request path.

Under tensor parallelism each rank holds a contiguous slice of the KV heads (vLLM's
QKVParallelLinear gives rank r heads [r * h, (r + 1) * h) of h per rank). A graft keeps
all heads: each rank restores its own slice of it, and a publish gathers every rank's
slice (one collective over the tensor-parallel group, which every rank enters: the
scheduler's metadata is the same on all of them) and rank 0 stores it.

Under pipeline parallelism each stage holds some of the layers: it restores its own layers
of the graft, and a publish joins the stages' layers at the last stage (stages.py).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import torch

from kvgraft.client import Registry
from kvgraft.errors import QuotaExceeded, RegistryError
from kvgraft.integrations.vllm import paged, restore, stages
from kvgraft.integrations.vllm.common import Context, KvgraftMetadata, LoadSpec, SaveSpec
from kvgraft.integrations.vllm.hot import HotChunks, MiB
from kvgraft.integrations.vllm.identity import EngineIdentity
from kvgraft.integrations.vllm.store import publish
from kvgraft.transfer.pull import Fetcher

log = logging.getLogger("vllm.kvgraft")
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


class KvgraftConnectorWorker:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._views: list[paged.PagedLayer] = []
        self._saving: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._load_errors: set[int] = set()
        self._bufs: list[bytearray] = []
        self._threads = restore.default_threads()
        self._hot = HotChunks(ctx.settings.memory_cache_mb * MiB)
        self._ranks, self._rank = 1, 0  # tensor-parallel size and this worker's rank
        self._heads = slice(None)  # the KV heads this rank holds
        self._first = 0  # the model's layer index of self._views[0] (a pipeline stage's)
        self._lead = True  # records the request's restore: rank 0 of stage 0
        self._stages: stages.Exchange | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ident = self.ctx.ident
        if ident is None:
            return
        try:
            by_index = {int(_LAYER_INDEX.search(n).group(1)): n for n in kv_caches}  # type: ignore[union-attr]
            indices = sorted(by_index)
            self._ranks, self._rank = _tensor_parallel_rank()
            stage, count = _pipeline_stage()
            dtype = paged.TORCH_DTYPES[ident.kv_dtype]
            if count > 1:
                # the group first: every worker must enter its creation, whatever follows
                group = stages.leaders_group(_stage_leaders())
                at = stages.layout(ident.layers, indices, stage, count, self._rank == 0)
                self._first, self._lead = at.first, self._rank == 0 and stage == 0
                self._stages = stages.Exchange(at, group, dtype, self._joined)
            elif indices != list(range(ident.layers)):
                raise RegistryError(f"{len(indices)} paged KV layers, model has {ident.layers}")
            else:
                self._lead = self._rank == 0
            per = ident.kv_heads // self._ranks
            self._heads = slice(self._rank * per, (self._rank + 1) * per)
            self._views = [paged.block_view(kv_caches[by_index[i]], per, self.ctx.block,
                                            ident.head_dim, dtype) for i in indices]
        except Exception as e:
            self.ctx.disable("connector disabled (paged KV layout)", e)

    def start_load_kv(self, meta: KvgraftMetadata) -> None:
        for spec in meta.loads:
            try:
                self._load(spec)
            except Exception as e:
                # The blocks hold nothing trustworthy: vLLM recomputes them
                # (kv_load_failure_policy "recompute") or fails the request ("fail").
                self._load_errors.update(spec.block_ids[spec.start // self.ctx.block:])
                self.ctx.fallback(spec.req_id, spec.plan.digest, e)

    def _load(self, spec: LoadSpec) -> None:
        registry, ident = self.ctx.registry, self.ctx.ident
        if registry is None or ident is None or not self._views:
            raise RegistryError("connector disabled")
        t0 = time.perf_counter()
        todo = [c for c in spec.plan.chunks
                if max(c[0], spec.start) < min(c[1], spec.plan.end)]
        threads = min(self._threads, len(todo))
        reader = restore.Reader(Fetcher(registry.store, registry.cache, keep_decoded=True),
                                self._hot, restore.buffers(threads, max(c[3] for c in todo),
                                                           self._bufs))
        target = restore.Target(self._views, self.ctx.block, spec.block_ids, spec.start,
                                spec.plan.end, self._views[0].dtype.itemsize, self._heads,
                                self._first)
        hits0 = self._hot.hits
        done = restore.load(reader, target, todo, threads)
        # hits: approximate if two restores overlap (a log figure)
        self._loaded(spec, done, time.perf_counter() - t0, self._hot.hits - hits0, len(todo))

    def _loaded(self, spec: LoadSpec, done: list[tuple[int, float]], seconds: float,
                in_memory: int, chunks: int) -> None:
        written = sum(w for w, _ in done)
        waited = sum(r for _, r in done)
        tokens = spec.plan.end - spec.start
        log.info("kvgraft: restored %d tokens of %s into %d blocks (%.1f MB in %.4f s; "
                 "%.4f thread-s reading and verifying chunks, the rest copying; "
                 "%d of %d chunks from memory)",
                 tokens, spec.plan.digest, len(spec.block_ids),
                 written / 1e6, seconds, waited, in_memory, chunks)
        if not self._lead:  # one restore of the request: counted and recorded once
            return
        self.ctx.counters.add("restored")
        self.ctx.counters.add("restored_tokens", tokens)
        self.ctx.record("restore", spec.plan.digest, "ok", {
            "request": spec.req_id, "tokens": tokens,
            "prefix_tokens": spec.plan.end, "bytes": written, "seconds": round(seconds, 6),
            "cross_engine": spec.plan.cross == "engine",
            "cross_layout": spec.plan.cross == "layout"})

    def save_kv_layer(self, meta: KvgraftMetadata, layer_name: str) -> None:
        if not meta.saves or self.ctx.ident is None:
            return
        m = _LAYER_INDEX.search(layer_name)
        if m is None:
            return
        view = self._views[int(m.group(1)) - self._first]
        for spec in meta.saves:
            self._saving.setdefault(spec.req_id, []).append(
                paged.gather(view, spec.block_ids))

    def wait_for_save(self, meta: KvgraftMetadata) -> None:
        if not meta.saves:
            return
        for spec in meta.saves:
            layers = self._saving.pop(spec.req_id, [])
            if self._ranks > 1:  # every rank enters the collective, whatever it then does
                layers = _all_heads(layers)
                if self._rank != 0:
                    continue
            if self._stages is not None:  # every stage hands over, whatever it then does
                self._stages.submit(spec, layers)
                continue
            self._publish(spec, layers)

    def _joined(self, spec: SaveSpec, layers: stages.Layers | None) -> None:
        """A publish's layers from every pipeline stage (None: a stage had none)."""
        if layers is not None:
            self._publish(spec, layers)

    def _publish(self, spec: SaveSpec, layers: stages.Layers) -> None:
        registry, ident = self.ctx.registry, self.ctx.keyed(spec.key)
        if registry is None or ident is None or len(layers) != ident.layers:
            return
        self.ctx.bg.submit("publish", self._publisher(registry, ident, spec, layers))

    def _publisher(self, registry: Registry, ident: EngineIdentity, spec: SaveSpec,
                   layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        repository, chunk = self.ctx.repository, self.ctx.chunk

        def job() -> None:
            t0 = time.perf_counter()
            try:
                digest = publish(registry, ident, repository, chunk, spec.token_ids, layers)
            except QuotaExceeded as e:  # the repository is full of pinned grafts
                self.ctx.counters.add("dropped.quota")
                log.warning("kvgraft: request %s not published: %s", spec.req_id, e)
                return
            self.ctx.counters.add("published")
            log.info("kvgraft: published %d tokens of request %s as %s@%s (%.3f s)",
                     len(spec.token_ids), spec.req_id, repository, digest,
                     time.perf_counter() - t0)
        return job

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._stages is not None:
            self._stages.close()
        self.ctx.close()


def _tensor_parallel_rank() -> tuple[int, int]:
    """(tensor-parallel size, this worker's rank)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()


def _pipeline_stage() -> tuple[int, int]:
    """(this worker's pipeline stage, the number of stages)."""
    from vllm.distributed import get_pp_group

    group = get_pp_group()
    return group.rank_in_group, group.world_size


def _stage_leaders() -> list[int]:
    """The global ranks of every stage's tensor-parallel rank 0, in stage order (vLLM puts
    the tensor-parallel ranks of a stage next to each other: rank = stage * tp + tp_rank)."""
    from vllm.distributed import get_pp_group, get_tp_group

    return [r - get_tp_group().rank_in_group for r in get_pp_group().ranks]


def _all_heads(layers: list[tuple[torch.Tensor, torch.Tensor]],
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's [heads, tokens, head_dim] slices of every layer, joined in rank order
    into all heads: one all-gather for all layers."""
    from vllm.distributed import get_tp_group

    if not layers:
        return layers
    mine = torch.stack([t for kv in layers for t in kv])  # [2 * layers, heads, tokens, dim]
    joined = get_tp_group().all_gather(mine, dim=1)
    return [(joined[2 * i].contiguous(), joined[2 * i + 1].contiguous())
            for i in range(len(layers))]

"""KvgraftConnector: vLLM's KV connector (v1 API) backed by the kvgraft registry.

vLLM loads this one class for every role and constructs it once per role, each in the
process that role runs in. As vLLM's own connectors do, it holds the side for its role and
hands each call of the v1 API to it:

  scheduler side (`scheduler.py`): for each new request, the longest prefix the registry
  holds for this engine, looked up and its chunks fetched off vLLM's scheduler thread; the
  restore plans and publishes the worker side carries out, as the step's metadata.
  worker side (`worker.py`): the planned chunks written into the blocks vLLM allocated,
  and the computed prompts published (whole blocks) by a background thread.

Both sides open their registry and engine identity the same way (`common.Context`).
Failures never reach vLLM: each one is logged, counted and recorded as an audit event,
and the request computes what it would have restored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvgraft.client import Registry
from kvgraft.integrations.background import Counters
from kvgraft.integrations.vllm.common import Context, KvgraftMetadata
from kvgraft.integrations.vllm.identity import EngineIdentity
from kvgraft.integrations.vllm.scheduler import KvgraftConnectorScheduler
from kvgraft.integrations.vllm.stats import KvgraftConnectorStats, KvgraftPromMetrics, StatsSource
from kvgraft.integrations.vllm.worker import KvgraftConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KvgraftConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        ctx = Context(vllm_config, self._kv_transfer_config, role.name.lower())
        self.connector_scheduler: KvgraftConnectorScheduler | None = None
        self.connector_worker: KvgraftConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvgraftConnectorScheduler(ctx)
        else:
            self.connector_worker = KvgraftConnectorWorker(ctx)
        self._ctx = ctx
        self._stats = StatsSource(ctx.counters)

    # what this side serves, for logs and tests
    @property
    def enabled(self) -> bool:
        return self._ctx.enabled

    @property
    def ident(self) -> EngineIdentity | None:
        return self._ctx.ident

    @property
    def registry(self) -> Registry | None:
        return self._ctx.registry

    @property
    def counters(self) -> Counters:
        return self._ctx.counters

    def _metadata(self) -> KvgraftMetadata | None:
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KvgraftMetadata) else None

    # --- scheduler side ------------------------------------------------------------------

    @property
    def scheduler(self) -> KvgraftConnectorScheduler:
        assert self.connector_scheduler is not None, "a call of the scheduler side"
        return self.connector_scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   ) -> tuple[int | None, bool]:
        answer = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        self._stats.answered(request.request_id, answer[0])
        return answer

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int],
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._stats.forget(request.request_id)
        return self.scheduler.request_finished(request)

    # --- worker side ---------------------------------------------------------------------

    @property
    def worker(self) -> KvgraftConnectorWorker:
        assert self.connector_worker is not None, "a call of the worker side"
        return self.connector_worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is not None:
            self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is not None:
            self.worker.save_kv_layer(meta, layer_name)

    def wait_for_save(self) -> None:
        meta = self._metadata()
        if meta is not None:
            self.worker.wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    # --- vLLM's metrics (kvgraft.integrations.vllm.stats) -------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector_scheduler is not None:  # asked once per step's output
            self.connector_scheduler.step_done()
        return self._stats.collect()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None,
                                 ) -> KVConnectorStats | None:
        return KvgraftConnectorStats(data=data) if data else KvgraftConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return KvgraftPromMetrics(vllm_config, metric_types, labelnames,
                                  per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

"""The connector's figures in vLLM's own metrics, through vLLM's KV connector stats interface.

Each side of the connector counts what it does in its `Counters` (common.Context): the
scheduler side lookups, hits and the fallbacks of lookups and fetches; the worker side
restores, tokens restored, restore seconds and publishes. vLLM asks each side for "the
stats of the last interval" (`get_kv_connector_stats`, the worker's after every step, the
scheduler's after every update), so a side hands over what it counted since it was last
asked (`StatsSource`). vLLM sends the worker's to the scheduler, aggregates both
(`KvgraftConnectorStats.aggregate`), logs them at its logging interval (`reduce`) and hands
them to the Prometheus logger, which records them through `KvgraftPromMetrics` as
`vllm:kvgraft_*` series beside vLLM's own, with vLLM's model and engine labels:

  vllm:kvgraft_lookups_total           requests vLLM asked the connector about (once each)
  vllm:kvgraft_hits_total              those it restored a prefix for (tokens > 0)
  vllm:kvgraft_restores_total          restores written into vLLM's cache
  vllm:kvgraft_restored_tokens_total   tokens they held
  vllm:kvgraft_fallbacks_total{reason} restores given up: the request computed its prefill
  vllm:kvgraft_skipped_total{reason}   requests not restored by choice: `slower` (restoring
                                       was estimated slower than the prefill), or neither
                                       restored nor published (`skipped.*` of keying)
  vllm:kvgraft_publishes_total{outcome} queued, stored, dropped (queue full), failed
  vllm:kvgraft_restore_seconds         a restore's time in the worker (histogram)

The payload is plain dicts of numbers: it crosses from the worker processes to the
scheduler's and on to the front end serialised.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvgraft.integrations.background import Counters

COUNTERS = "counters"
SAMPLES = "samples"
RESTORE_SECONDS = "restore_seconds"
PUBLISH_OUTCOMES = {"queued.publish": "queued", "published": "stored",
                    "dropped.publish": "dropped", "dropped.quota": "over_quota",
                    "failed.publish": "failed"}
PLAIN = {"lookups": "lookups", "hits": "hits", "restored": "restores",
         "restored_tokens": "restored_tokens"}
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class KvgraftConnectorStats(KVConnectorStats):
    """One interval's figures: counter increments by name and restore-time samples."""

    def __post_init__(self) -> None:
        if COUNTERS not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {COUNTERS: {}, SAMPLES: {}}

    @property
    def counters(self) -> dict[str, int]:
        c: dict[str, int] = self.data[COUNTERS]
        return c

    @property
    def samples(self) -> dict[str, list[float]]:
        s: dict[str, list[float]] = self.data[SAMPLES]
        return s

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        assert isinstance(other, KvgraftConnectorStats)
        for name, n in other.counters.items():
            self.counters[name] = self.counters.get(name, 0) + n
        for name, values in other.samples.items():
            self.samples.setdefault(name, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {f"kvgraft.{k}": v for k, v in sorted(self.counters.items())}
        for name, values in sorted(self.samples.items()):
            out[f"kvgraft.{name}_count"] = len(values)
            out[f"kvgraft.{name}_sum"] = round(sum(values), 6)
        return out

    def is_empty(self) -> bool:
        return not any(self.counters.values()) and not any(self.samples.values())


class StatsSource:
    """What one side counted since vLLM last asked, and which requests it has answered a
    lookup for (so a request asked about again, after preemption, counts once)."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self._last: dict[str, int] = {}
        self._answered: set[str] = set()
        self._lock = threading.Lock()

    def answered(self, req_id: str, tokens: int | None) -> None:
        """vLLM's question about `req_id` got `tokens` (None: not known yet)."""
        if tokens is None or req_id in self._answered:
            return
        self._answered.add(req_id)
        self.counters.add("lookups")
        if tokens > 0:
            self.counters.add("hits")

    def forget(self, req_id: str) -> None:
        self._answered.discard(req_id)

    def collect(self) -> KvgraftConnectorStats | None:
        with self._lock:
            now = self.counters.snapshot()
            delta = {k: v - self._last.get(k, 0) for k, v in now.items()
                     if v != self._last.get(k, 0)}
            self._last = now
        stats = KvgraftConnectorStats(data={COUNTERS: delta,
                                            SAMPLES: self.counters.drain_samples()})
        return None if stats.is_empty() else stats


class KvgraftPromMetrics(KVConnectorPromMetrics):
    """The `vllm:kvgraft_*` series (built by vLLM's Prometheus logger, with its metric
    classes and its model and engine labels)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str, *extra: str) -> Any:
            return self._counter_cls(name=f"vllm:kvgraft_{name}", documentation=doc,
                                     labelnames=[*labelnames, *extra])

        self.plain = {
            "lookups": counter("lookups", "Requests vLLM asked the kvgraft connector about."),
            "hits": counter("hits", "Requests the kvgraft connector restored a prefix for."),
            "restores": counter("restores", "Prefixes restored from the kvgraft registry."),
            "restored_tokens": counter("restored_tokens", "Tokens restored from kvgraft."),
        }
        self.fallbacks = counter("fallbacks", "kvgraft restores given up (the request "
                                 "computed its prefill), by reason.", "reason")
        self.skipped = counter("skipped", "Requests kvgraft chose not to restore, by reason "
                               "(slower: restoring was estimated slower than computing).",
                               "reason")
        self.publishes = counter("publishes", "kvgraft publishes, by outcome (queued, "
                                 "stored, dropped: queue full, failed).", "outcome")
        histogram: Any = self._histogram_cls  # vLLM's class (prometheus_client's, or Ray's)
        self.seconds = histogram(
            name="vllm:kvgraft_restore_seconds", documentation="Time a kvgraft restore "
            "took in the worker (reading, verifying, writing into vLLM's cache).",
            labelnames=labelnames, buckets=list(SECONDS_BUCKETS))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for name, n in dict(transfer_stats_data.get(COUNTERS, {})).items():
            if n <= 0:
                continue
            if name in PLAIN:
                self.plain[PLAIN[name]].labels(*labels).inc(n)
            elif name in PUBLISH_OUTCOMES:
                self.publishes.labels(*labels, PUBLISH_OUTCOMES[name]).inc(n)
            elif name.startswith("fallback."):
                self.fallbacks.labels(*labels, name.removeprefix("fallback.")).inc(n)
            elif name.startswith("skipped."):
                self.skipped.labels(*labels, name.removeprefix("skipped.")).inc(n)
        for value in dict(transfer_stats_data.get(SAMPLES, {})).get(RESTORE_SECONDS, []):
            self.seconds.labels(*labels).observe(float(value))

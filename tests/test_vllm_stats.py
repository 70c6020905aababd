"""The vLLM connector's figures through vLLM's own KV connector stats API, without an
engine: what one side hands vLLM per interval, vLLM's aggregation and interval log
(KVConnectorLogging, which resolves the connector class by its module path as an engine
does), and the `vllm:kvgraft_*` Prometheus series vLLM's logger records them into."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
)

from kvgraft.integrations.background import Background, Counters
from kvgraft.integrations.vllm.connector import KvgraftConnector
from kvgraft.integrations.vllm.stats import KvgraftConnectorStats, StatsSource

LABELS = ["model_name", "engine"]


def test_a_side_hands_over_what_it_counted_since_it_was_last_asked() -> None:
    counters = Counters()
    source = StatsSource(counters)
    assert source.collect() is None
    source.answered("r1", None)  # not known yet: nothing counted
    source.answered("r1", 256)
    source.answered("r1", 256)  # asked again (preempted): one lookup
    source.answered("r2", 0)
    counters.add("fallback.integrity")
    counters.observe("restore_seconds", 0.25)
    first = source.collect()
    assert first is not None
    assert first.counters == {"lookups": 2, "hits": 1, "fallback.integrity": 1}
    assert first.samples == {"restore_seconds": [0.25]}
    assert source.collect() is None  # nothing new
    counters.add("published")
    again = source.collect()
    assert again is not None and again.counters == {"published": 1}


def test_publishes_queued_and_dropped_are_counted_by_the_queue() -> None:
    counters = Counters()
    bg = Background("test", 1, counters)
    bg.close(5)  # the thread is gone: nothing drains the queue now
    assert bg.submit("publish", lambda: None)
    assert not bg.submit("publish", lambda: None)
    snap = counters.snapshot()
    assert snap["queued.publish"] == 1 and snap["dropped.publish"] == 1


def _interval(**counters: int) -> dict[str, Any]:
    stats = KvgraftConnectorStats()
    stats.counters.update(counters)
    return stats.to_dict()


def test_vllm_aggregates_and_logs_the_intervals_of_both_sides() -> None:
    ktc = KVTransferConfig(kv_connector="KvgraftConnector", kv_role="kv_both",
                           kv_connector_module_path="kvgraft.integrations.vllm")
    logging = KVConnectorLogging(ktc)
    assert logging.connector_cls is KvgraftConnector
    worker = _interval(restored=1, restored_tokens=512, published=2)
    worker["samples"] = {"restore_seconds": [0.5, 0.25]}
    logging.observe(worker)
    logging.observe(_interval(lookups=3, hits=1, **{"fallback.timeout": 1}))
    logging.observe(_interval(restored=1, restored_tokens=256))
    lines: list[str] = []
    logging.log(lambda fmt, text: lines.append(fmt % text))  # type: ignore[no-untyped-call]
    assert len(lines) == 1
    logged = dict(part.split("=") for part in lines[0].split(": ", 1)[1].split(", "))
    assert logged == {"kvgraft.restored": "2", "kvgraft.restored_tokens": "768",
                      "kvgraft.published": "2", "kvgraft.lookups": "3", "kvgraft.hits": "1",
                      "kvgraft.fallback.timeout": "1", "kvgraft.restore_seconds_count": "2",
                      "kvgraft.restore_seconds_sum": "0.75"}
    assert KvgraftConnector.build_kv_connector_stats(None).is_empty()  # type: ignore[union-attr]


def test_the_figures_become_vllm_kvgraft_series() -> None:
    registry = CollectorRegistry()

    def bound(cls: Any) -> Any:
        class Bound(cls):  # type: ignore[misc]
            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, registry=registry, **kw)
        return Bound

    types: Any = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    prom = KvgraftConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
                                               types, LABELS, {0: ["m", "0"]})
    assert prom is not None
    data = _interval(lookups=4, hits=3, restored=3, restored_tokens=900,
                     **{"queued.publish": 2, "published": 1, "dropped.publish": 1,
                        "fallback.integrity": 1, "queued.event": 5})
    data["samples"] = {"restore_seconds": [0.02, 0.3]}
    prom.observe(data, 0)
    prom.observe(_interval(lookups=1), 0)
    at = {"model_name": "m", "engine": "0"}
    value = registry.get_sample_value
    assert value("vllm:kvgraft_lookups_total", at) == 5
    assert value("vllm:kvgraft_hits_total", at) == 3
    assert value("vllm:kvgraft_restores_total", at) == 3
    assert value("vllm:kvgraft_restored_tokens_total", at) == 900
    assert value("vllm:kvgraft_fallbacks_total", {**at, "reason": "integrity"}) == 1
    for outcome, n in (("queued", 2), ("stored", 1), ("dropped", 1)):
        assert value("vllm:kvgraft_publishes_total", {**at, "outcome": outcome}) == n
    assert value("vllm:kvgraft_restore_seconds_count", at) == 2
    assert value("vllm:kvgraft_restore_seconds_sum", at) == pytest.approx(0.32)

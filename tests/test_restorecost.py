"""The restore-cost estimator: a restore happens only when it beats computing the prefill."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgraft.errors import UsageError
from kvgraft.formats.manifest import BlobRef
from kvgraft.integrations.prefetch import prefetch
from kvgraft.integrations.restorecost import (
    LOOKUP_FIRST,
    LOOKUP_WINDOW,
    RESTORE_FIRST,
    PrefillSpeed,
    RestoreCost,
    StoreSpeed,
    check_rate,
    check_restore_when,
    fetch_rounds,
)
from kvgraft.transfer.pull import transfer_workers
from kvgraft.transfer.push import PushOptions
from tests.support.harness import RegistryFactory
from tests.support.synthetic import write_synthetic

KV_PER_TOKEN = 23_040  # SmolLM2-135M, bf16: 30 layers, K and V, 3 heads of 64
CHUNK = 256


def chunks(tokens: int) -> list[int]:
    """Chunk sizes of a prefix of `tokens` tokens."""
    full, rest = divmod(tokens, CHUNK)
    return [CHUNK * KV_PER_TOKEN] * full + ([rest * KV_PER_TOKEN] if rest else [])


def measured(store_bytes_per_s: float, latency: float, prefill_tokens_per_s: float,
             when: str = "faster") -> RestoreCost:
    """An estimator that measured a store and an engine at these speeds (fetching one blob
    at a time: every blob pays the latency)."""
    cost = RestoreCost(when, fetch_threads=1)
    for _ in range(20):
        for size in (CHUNK * KV_PER_TOKEN, 16 * KV_PER_TOKEN):
            cost.store.observe(size, 1, latency + size / store_bytes_per_s)
        cost.prefill.observe(0, 0.01)  # a decode step: the overhead
        cost.prefill.observe(512, 0.01 + 512 / prefill_tokens_per_s)
    return cost


def test_blobs_fetched_at_once_pay_the_latency_once_a_round() -> None:
    assert [fetch_rounds(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    one, four = RestoreCost(fetch_threads=1), RestoreCost(fetch_threads=4)
    for cost in (one, four):
        for _ in range(20):
            for size in (1_000, 1_000_000):
                cost.store.observe(size, 1, 0.1 + size / 1e8)
    sizes = [1_000_000] * 8
    a, b = one.estimate(2048, sizes, 0).restore_s, four.estimate(2048, sizes, 0).restore_s
    assert a is not None and b is not None
    assert a - b == pytest.approx((8 - 2) * 0.1, rel=0.05)  # 8 rounds against 2


def test_prefetch_fetches_together_and_measures_the_rounds(make_registry: RegistryFactory,
                                                          tmp_path: Path) -> None:
    kv = tmp_path / "g.kv"
    write_synthetic(kv, num_layers=2, kv_heads=2, head_dim=64, tokens=1024, dtype="BF16",
                    seed=5, name="g")
    digest = make_registry().push(kv, "r/g:v1", options=PushOptions(chunk_tokens=128)).digest
    other = make_registry(cache_dir=tmp_path / "other-cache")  # same store, empty cache
    refs = [BlobRef(c.digest, c.size) for c in other.manifest(digest).chunks]
    seen: list[tuple[int, int, float]] = []
    fetched = prefetch(other, refs, lambda b, r, s: seen.append((b, r, s)))
    assert fetched > 0 and all(other.cache.has(r.digest) for r in refs)
    assert [(b, r) for b, r, _ in seen] == [
        (sum(r.size for r in refs), fetch_rounds(len(refs), transfer_workers()))]
    assert prefetch(other, refs, lambda *a: seen.append(a)) == 0 and len(seen) == 1


def decide(cost: RestoreCost, tokens: int, cached: bool = False) -> bool:
    sizes = chunks(tokens)
    if cached:
        return cost.estimate(tokens, [], sum(sizes)).restores
    return cost.estimate(tokens, sizes, 0).restores


def test_measured_speeds_converge() -> None:
    cost = measured(100e6, 0.02, 1000)
    assert cost.store.bytes_per_s == pytest.approx(100e6, rel=0.05)
    assert cost.store.latency == pytest.approx(0.02, rel=0.1)
    assert cost.prefill.tokens_per_s == pytest.approx(1000, rel=0.05)
    assert cost.prefill.seconds(1000) == pytest.approx(1.0, rel=0.05)


def test_short_prefixes_compute_long_ones_restore() -> None:
    # 1 Gbit/s with 20 ms a request, against 1000 prompt tokens/s: a chunk of 256 tokens
    # costs 20 ms + 47 ms to fetch and 256 ms to compute, 16 tokens 20 ms + 3 ms vs 16 ms
    cost = measured(125e6, 0.02, 1000)
    assert not decide(cost, 16)
    assert decide(cost, 256)
    assert decide(cost, 4096)
    estimate = cost.estimate(16, chunks(16), 0)
    assert estimate.restore_s is not None and estimate.restore_s > estimate.prefill_s
    assert "vs prefill" in estimate.describe()


def test_slow_store_computes_but_a_cached_prefix_restores() -> None:
    cost = measured(10e6, 0.005, 1000)  # 10 MB/s: 2.3 ms a token, prefill 1 ms
    assert not decide(cost, 256)
    assert not decide(cost, 4096)
    assert decide(cost, 256, cached=True)
    assert decide(cost, 16, cached=True)


def test_store_getting_slower_flips_the_decision() -> None:
    cost = measured(125e6, 0.002, 1000)
    assert decide(cost, 1024)
    size = CHUNK * KV_PER_TOKEN
    for _ in range(10):  # now 5 MB/s
        cost.store.observe(size, 1, 0.002 + size / 5e6)
    assert not decide(cost, 1024)
    for _ in range(10):  # and fast again
        cost.store.observe(size, 1, 0.002 + size / 125e6)
    assert decide(cost, 1024)


def test_engine_getting_faster_flips_the_decision() -> None:
    cost = measured(50e6, 0.002, 1000)
    assert decide(cost, 1024)
    for _ in range(10):
        cost.prefill.observe(512, 0.01 + 512 / 20_000)
    assert not decide(cost, 1024)


def test_always_restores_and_unknown_store_restores_to_measure_it() -> None:
    slow = measured(1e6, 0.1, 10_000, when="always")
    assert decide(slow, 16)
    fresh = RestoreCost()
    estimate = fresh.estimate(16, [16 * KV_PER_TOKEN], 0)
    assert estimate.restore_s is None and estimate.restores
    assert "unknown" in estimate.describe()
    # nothing to fetch: only the local copy counts, even before the store is measured
    local = fresh.estimate(16, [], 16 * KV_PER_TOKEN)
    assert local.restore_s is not None and local.restores


def test_a_lookup_happens_only_when_it_costs_a_tenth_of_the_prefill() -> None:
    cost = measured(125e6, 0.02, 1000)  # 1 ms a prompt token
    assert cost.lookup_pays(1) and cost.lookup_s is None  # not measured: look it up
    for _ in range(20):
        cost.observe_lookup(0.05)
    assert cost.lookup_s == pytest.approx(0.05)
    assert not cost.lookup_pays(34)  # 34 ms of prefill cannot carry a 50 ms lookup
    assert not cost.lookup_pays(499)
    assert cost.lookup_pays(500) and cost.lookup_pays(8192)
    cost.observe_lookup(-1.0)  # a clock step back is not a measurement
    assert cost.lookup_s == pytest.approx(0.05)
    always = measured(125e6, 0.02, 1000, when="always")
    always.observe_lookup(1.0)
    assert always.lookup_pays(1)


def test_what_a_few_lookups_pay_once_does_not_shut_the_gate() -> None:
    """A lookup that makes the store's client or first fetches a candidate's manifest
    through a slow link takes 0.2-0.4 s, where the lookups after it take 5-75 ms."""
    cost = measured(125e6, 0.02, 1000)  # 1 ms a prompt token: 100 tokens carry 10 ms
    cost.observe_lookup(0.37)
    assert cost.lookup_pays(5)  # the first few are looked up whatever they cost
    cost.observe_lookup(0.005)
    assert cost.lookup_pays(5)
    cost.observe_lookup(0.006)
    assert cost.lookup_s == pytest.approx(0.006)
    assert cost.lookup_pays(100) and not cost.lookup_pays(50)
    cost.observe_lookup(0.4)  # fewer than half the lookups slow: the median stays
    assert cost.lookup_s == pytest.approx(0.006) and cost.lookup_pays(100)
    for _ in range(LOOKUP_WINDOW):
        cost.observe_lookup(0.5)  # a catalog that stays slow shuts it
    assert cost.lookup_s == pytest.approx(0.5) and not cost.lookup_pays(4000)


def test_a_slow_lookup_is_measured_again_once_per_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Skipped lookups measure nothing: without a periodic one, a lookup measured slow
    once (a busy catalog) would keep every later prompt from being looked up."""
    clock = [1000.0]
    monkeypatch.setattr("kvgraft.integrations.restorecost.time",
                        SimpleNamespace(monotonic=lambda: clock[0]))
    cost = measured(125e6, 0.02, 1000)
    cost.probe_interval = 60.0
    for _ in range(LOOKUP_FIRST):
        cost.observe_lookup(1.0)
    assert not cost.lookup_pays(100)
    clock[0] += 59.0
    assert not cost.lookup_pays(100)
    clock[0] += 1.0
    assert cost.lookup_pays(100)  # the interval passed: one lookup goes through
    assert not cost.lookup_pays(100)  # and only one, until it is measured or the next
    for _ in range(30):
        cost.observe_lookup(0.001)  # the catalog is fast again
    assert cost.lookup_pays(100)


def test_default_prefill_rate_until_measured() -> None:
    p = PrefillSpeed(500.0)
    assert not p.measured and p.seconds(1000) == pytest.approx(2.0)
    p.observe(1, 0.5)  # too few tokens: an overhead, not a rate
    assert not p.measured
    p.observe(1000, 1.5)
    assert p.measured and p.seconds(1000) == pytest.approx(1.0)


def test_probe_due_once_per_interval() -> None:
    cost = RestoreCost(probe_interval=3600)
    assert cost.probe_due()
    assert not cost.probe_due()
    cost = RestoreCost(probe_interval=3600)
    cost.store.observe(1000, 1, 0.01)  # a fetch was just measured: no probe needed
    assert not cost.probe_due()


def test_settings_are_checked() -> None:
    assert check_restore_when("always") == "always"
    with pytest.raises(UsageError):
        check_restore_when("sometimes")
    assert check_rate("x", "1500") == 1500.0
    for bad in (0, -1, "fast", True, float("nan"), float("inf"), None):
        with pytest.raises(UsageError):
            check_rate("x", bad)
    with pytest.raises(UsageError):
        RestoreCost("never")


@given(st.floats(1e5, 1e10), st.floats(0.0, 0.5), st.integers(1, 1 << 26))
def test_repeated_fetches_predict_their_own_time(rate: float, latency: float,
                                                 size: int) -> None:
    """Fetches of one size, however the time splits into latency and transfer: the
    estimate for that size converges to the time measured."""
    s = StoreSpeed()
    seconds = latency + size / rate
    for _ in range(40):
        s.observe(size, 1, seconds)
    got = s.seconds(size, 1)
    assert got is not None and got == pytest.approx(seconds, rel=0.02)


@given(st.lists(st.tuples(st.integers(0, 1 << 24), st.integers(1, 8),
                          st.floats(1e-6, 10.0)), max_size=30),
       st.integers(0, 1 << 30), st.integers(0, 64))
def test_estimates_are_finite_and_monotone(observations: list[tuple[int, int, float]],
                                           nbytes: int, requests: int) -> None:
    s = StoreSpeed()
    for b, r, t in observations:
        s.observe(b, r, t)
    got = s.seconds(nbytes, requests)
    if not any(t > 0 for _, _, t in observations):  # nothing measured
        assert got == (None if requests else 0.0)
        return
    assert got is not None
    assert 0 <= got < float("inf")
    more = s.seconds(nbytes + 1000, requests + 1)
    assert more is not None and more >= got


def test_a_restore_must_be_clearly_faster() -> None:
    # 1000 tokens/s; 1024 tokens from the machine cache at 1 GB/s local speed: 23.6 ms
    # against 1024 ms; then a fixed overhead moves the restore to 0.9x and 0.7x of it
    cost = measured(125e6, 0.002, 1000)
    nbytes = 1024 * KV_PER_TOKEN
    base = cost.estimate(1024, [], nbytes)
    assert base.restore_s is not None and base.overhead_s == 0 and base.restores
    prefill = base.prefill_s
    cost.overhead_s = 0.9 * prefill - base.restore_s
    near = cost.estimate(1024, [], nbytes)
    assert near.restore_s == pytest.approx(0.9 * prefill) and not near.restores
    cost.overhead_s = 0.7 * prefill - base.restore_s
    assert cost.estimate(1024, [], nbytes).restores


def test_the_first_restores_measure_no_overhead() -> None:
    """What the first restores of a process pay once (0.37-0.43 s on one machine, against
    0-0.13 s after them) would keep short prompts computing for good: a prompt that
    computes measures no overhead, so nothing would bring the estimate back down."""
    cost = measured(125e6, 0.002, 1000)
    nbytes = 512 * KV_PER_TOKEN
    estimate = cost.estimate(512, [], nbytes)
    assert estimate.restore_s is not None and estimate.restores
    for _ in range(RESTORE_FIRST):
        cost.observe_restore(estimate.restore_s + 0.5, estimate)  # 0.5 s beyond: paid once
        assert cost.overhead_s is None and cost.estimate(512, [], nbytes).restores
    cost.observe_restore(estimate.restore_s + 0.05, estimate)  # the next: measured
    assert cost.overhead_s == pytest.approx(0.05)


def test_each_restore_measures_its_overhead() -> None:
    cost = measured(125e6, 0.002, 1000)
    nbytes = 1024 * KV_PER_TOKEN
    estimate = cost.estimate(1024, [], nbytes)
    assert estimate.restore_s is not None and cost.overhead_s is None
    for _ in range(RESTORE_FIRST):  # not measured
        cost.observe_restore(estimate.restore_s, estimate)
    assert cost.overhead_s is None
    # took its estimate, 44 computed tokens and 0.9 s besides: 0.9 s overhead
    tail = cost.prefill.seconds(44)
    cost.observe_restore(estimate.restore_s + tail + 0.9, estimate, 44)
    assert cost.overhead_s == pytest.approx(0.9)
    later = cost.estimate(1024, [], nbytes)
    assert later.overhead_s == pytest.approx(0.9)
    assert later.restore_s == pytest.approx(estimate.restore_s + 0.9)
    assert not later.restores  # 0.92 s against 1.02: not clearly faster
    assert "0.9000 s overhead" in later.describe()
    # a restore faster than its estimate measures no overhead (never below 0): the
    # estimate (its overhead included) comes back down
    for _ in range(20):
        cost.observe_restore(0.0, later)
    assert cost.overhead_s == pytest.approx(0.0, abs=1e-3)
    assert cost.estimate(1024, [], nbytes).restores
    # an estimate of an unmeasured store, or a negative time, measures nothing
    fresh = RestoreCost()
    fresh.observe_restore(1.0, fresh.estimate(16, [16 * KV_PER_TOKEN], 0))
    fresh.observe_restore(-1.0, fresh.estimate(16, [], 16 * KV_PER_TOKEN))
    assert fresh.overhead_s is None


def test_an_overhead_that_stops_restores_is_measured_again_once_per_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt that computes measures no overhead: without a restore now and then, one
    overhead measured high (a restore that met a busy step) would keep every prompt its
    overhead alone makes slower computing for good."""
    clock = [1000.0]
    monkeypatch.setattr("kvgraft.integrations.restorecost.time",
                        SimpleNamespace(monotonic=lambda: clock[0]))
    cost = measured(125e6, 0.002, 1000)
    cost.probe_interval = 60.0
    nbytes = 1024 * KV_PER_TOKEN
    estimate = cost.estimate(1024, [], nbytes)
    assert estimate.restore_s is not None
    for _ in range(RESTORE_FIRST + 1):  # the last one measures 0.9 s of overhead
        cost.observe_restore(estimate.restore_s + 0.9, estimate)
    assert cost.overhead_s == pytest.approx(0.9)
    clock[0] += 59.0
    assert not cost.estimate(1024, [], nbytes).restores  # within the interval: computes
    clock[0] += 1.0
    probe = cost.estimate(1024, [], nbytes)
    assert probe.restores and probe.probe and not probe.faster
    assert "to measure the overhead again" in probe.describe()
    assert not cost.estimate(1024, [], nbytes).restores  # one probe per interval
    cost.observe_restore(estimate.restore_s, probe)  # it paid no overhead this time
    assert cost.overhead_s == pytest.approx(0.9 * 0.7)
    # a restore slower than computing even without its overhead is never a probe
    clock[0] += 3600.0
    slow = cost.estimate(1024, chunks(1024) * 40, 0)
    assert not slow.faster and not slow.restores and not slow.probe
    # nor is one while no overhead has been measured
    fresh = measured(125e6, 0.002, 1000)
    fresh.overhead_s = 0.9
    assert not fresh.estimate(1024, [], nbytes).restores

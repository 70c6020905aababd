"""Whether restoring a prefix pays: its estimated time against computing it.

A restore is worth doing only when it is faster than the prefill it replaces. Its cost is
what the machine cache lacks, fetched from the store, plus verifying and copying every
byte; the prefill's is the tokens it saves at the rate the engine computes prompts:

    restore_s = rounds * latency + missing_bytes / store_rate + bytes / LOCAL_RATE
                + overhead
    prefill_s = tokens / prefill_rate

where `rounds` is how many requests follow one another when the missing blobs are fetched
`fetch_threads` at a time, as a restore fetches them (`fetch_rounds`): the store's latency
is paid once a round, its bytes/s shared by the requests of a round.

and the request restores when `restore_s <= RESTORE_MARGIN * prefill_s` (with
`restore_when = "always"` it restores whatever the figures). The margin is there because
both sides are estimates of a machine whose load moves them (a prefill measured at one
moment may take 30% more or less at the next): a restore chosen on a near tie costs up to
that much more than computing, while computing a prompt that would have restored a little
faster loses only that little. The figures are measured in the process, from what it does:

- `StoreSpeed`: each fetch from the store (bytes, rounds of requests, seconds) updates
  exponentially weighted estimates of the store's per-request latency and its bytes/s.
  Until the first fetch is measured the store's speed is unknown and a restore goes ahead:
  it measures it.
- `PrefillSpeed`: each prompt the engine computes (tokens, seconds) updates an exponentially
  weighted estimate of seconds per prompt token (weighted by tokens); a step that computes
  no prompt (a decode step) measures the per-step overhead, taken off a prompt's time. Until
  the first prompt is measured, `DEFAULT_PREFILL_TOKENS_PER_S` (or the engine's setting).

- `overhead`: what a restore costs besides its bytes, as each restore measures it (its time
  from the decision until its KV is in place and the rest of the prompt computed, less the
  estimate of its bytes and of that rest): on vLLM the scheduler step the request waits for
  and the step that copies its blocks. Weighted like the others; 0 until measured. The first
  `RESTORE_FIRST` restores of a process are not measured, as the first lookups are not gated:
  they pay what is paid once (the worker's first copies into the paged cache, its threads
  and buffers made, the engine's first steps of a new shape): 0.37-0.43 s on one 2-core
  machine against 0-0.13 s for the restores after them, which, weighted in, kept short
  prompts from restoring for good (a prompt that computes measures no overhead). For the
  same reason a measured overhead that alone makes restores slower than computing is
  measured again: at most once per `probe_interval` (and not within one of the last restore
  measured) such a restore goes ahead anyway (`Estimate.probe`), costing at most that
  overhead once.

A lookup costs time too, paid whether or not it finds a restore that pays: a prompt is
looked up only when the measured lookup time is at most `LOOKUP_SHARE` (a tenth) of the
prefill it could save (`RestoreCost.lookup_pays`), so a prompt too short to gain from the
registry computes at most that much later than without it. The time measured is the
median of the last `LOOKUP_WINDOW` lookups (the lower one of an even count), and the first
`LOOKUP_FIRST` prompts are looked up whatever they cost: every lookup pays the catalog's
query and the machine cache's reads, and a few pay besides what is paid once (the store's
client made, a candidate's manifest fetched the first time through a slow link: 0.22-0.37
s measured behind a 50 ms link, against 5-75 ms for the lookups after it), which, weighted
in, would shut the gate for prompts that gain from a restore. Lookups skipped are not
measured, so a catalog measured slow would shut the gate for good: at most once per
`probe_interval` a prompt the gate would skip is looked up anyway, and measures the lookup
again.

A store that gets slower turns restores into computes; while restores are skipped nothing
fetches, so at most once per `probe_interval` a skipped restore's chunks are fetched in the
background instead (`RestoreCost.probe_due`): the store is measured again, and the prefix
is then in the machine cache for the next request. One implementation for every engine
(the vLLM connector, the llama.cpp prompt cache); pure logic, no engine imported.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvgraft.errors import UsageError
from kvgraft.transfer.pull import transfer_workers

RESTORE_WHEN = ("faster", "always")
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0  # before the engine computed any prompt
LOCAL_BYTES_PER_S = 1e9  # verifying and copying bytes the machine cache holds
FIRST_LATENCY_S = 0.005  # per request, for splitting the first fetch measured
ALPHA = 0.3  # weight of a new measurement
PROBE_INTERVAL_S = 60.0
PREFILL_MIN_TOKENS = 2  # fewer: the step's time is its overhead
LOOKUP_SHARE = 0.1  # a lookup's time, at most, against the prefill it could save
RESTORE_MARGIN = 0.8  # a restore's estimate, at most, against the prefill it saves
LOOKUP_WINDOW = 8  # the lookups whose median time is the lookup's
LOOKUP_FIRST = 3  # lookups made whatever they cost, before the gate has a median
RESTORE_FIRST = 3  # restores whose overhead is not measured (they pay what is paid once)


def fetch_rounds(blobs: int, threads: int) -> int:
    """Requests one after another when `blobs` are fetched `threads` at a time."""
    return -(-blobs // max(1, threads))


def check_restore_when(value: object) -> str:
    if value not in RESTORE_WHEN:
        raise UsageError(f"restore_when must be one of {', '.join(RESTORE_WHEN)}, "
                         f"not {value!r}")
    return str(value)


def check_rate(name: str, value: object) -> float:
    try:
        rate = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        rate = float("nan")
    if isinstance(value, bool) or not 0 < rate < float("inf"):
        raise UsageError(f"{name} must be a positive number, not {value!r}")
    return rate


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


class _Turns:
    """An act let through at most once per interval, and not within an interval of the
    measurement it stands in for (the caller holds the lock)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = float("-inf")

    def take(self, interval: float, measured_at: float | None) -> bool:
        now = time.monotonic()
        if now - self.last < interval or (measured_at is not None
                                          and now - measured_at < interval):
            return False
        self.last = now
        return True


class StoreSpeed:
    """The store's per-request latency (seconds) and bytes/s, from measured fetches.

    Fetches of varied sizes are fitted (an exponentially weighted least-squares line of
    seconds against bytes, per request: its intercept is the latency, its slope the time
    per byte); while the sizes vary too little to tell the two apart, each measurement
    splits its time with the estimates it had (the time beyond the transfer is latency,
    the time beyond the latency, at least half, transfer), which keeps the estimate for
    the sizes measured equal to their time."""

    def __init__(self, alpha: float = ALPHA) -> None:
        self.alpha = alpha
        self.latency: float | None = None
        self.bytes_per_s: float | None = None
        self.observed_at: float | None = None  # time.monotonic() of the last fetch
        self._sums = [0.0] * 5  # weighted: 1, x, y, x*x, x*y (x bytes, y seconds a request)
        self._lock = threading.Lock()

    def observe(self, nbytes: int, requests: int, seconds: float) -> None:
        """`requests` fetches of `nbytes` in all took `seconds`."""
        if requests <= 0 or nbytes < 0 or not seconds > 0:
            return
        with self._lock:
            self.observed_at = time.monotonic()
            x, y = max(nbytes, 1) / requests, seconds / requests
            keep = 1.0 - self.alpha
            for i, v in enumerate((1.0, x, y, x * x, x * y)):
                self._sums[i] = self._sums[i] * keep + v
            if self.latency is None or self.bytes_per_s is None:
                # the first: transfer, but for a small latency (at most half the time)
                self.latency = min(FIRST_LATENCY_S, y / 2)
                self.bytes_per_s = x / (y - self.latency)
                return
            fitted = self._fit()
            if fitted is not None:
                self.latency, self.bytes_per_s = fitted
                return
            lat = max(0.0, y - x / self.bytes_per_s)
            rate = x / max(y - self.latency, y / 2)
            self.latency = _ewma(self.latency, min(lat, y), self.alpha)
            self.bytes_per_s = _ewma(self.bytes_per_s, rate, self.alpha)

    def _fit(self) -> tuple[float, float] | None:
        """(latency, bytes/s) of the weighted line, None while sizes barely vary."""
        w, sx, sy, sxx, sxy = self._sums
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if not var > (0.1 * mx) ** 2:
            return None
        slope = (sxy / w - mx * my) / var
        latency = my - slope * mx
        if slope <= 0 or latency < 0:
            return None
        return latency, 1.0 / slope

    def seconds(self, nbytes: int, requests: int) -> float | None:
        """Estimated seconds to fetch `nbytes` in `requests`; None: not measured yet."""
        with self._lock:
            if self.latency is None or self.bytes_per_s is None:
                return None if requests else 0.0
            return requests * self.latency + nbytes / self.bytes_per_s

class PrefillSpeed:
    """Seconds per prompt token the engine computes, from the prompts it computed: the
    ratio of exponentially weighted sums of their seconds and their tokens, so a long
    prompt weighs more than the few tokens computed after a restore (whose time is mostly
    the engine's per-step overhead)."""

    def __init__(self, tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
                 alpha: float = ALPHA) -> None:
        self.alpha = alpha
        self.default = 1.0 / tokens_per_s
        self.overhead: float | None = None  # a step's seconds besides its prompt tokens
        self._seconds = self._tokens = 0.0
        self._lock = threading.Lock()

    @property
    def measured(self) -> bool:
        return self._tokens > 0

    @property
    def per_token(self) -> float:
        with self._lock:
            return self._seconds / self._tokens if self._tokens > 0 else self.default

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.per_token

    def observe(self, tokens: int, seconds: float) -> None:
        """A step (or a prompt) that computed `tokens` prompt tokens took `seconds`."""
        if not seconds > 0 or tokens < 0:
            return
        with self._lock:
            if tokens < PREFILL_MIN_TOKENS:
                self.overhead = _ewma(self.overhead, seconds, self.alpha)
                return
            keep = 1.0 - self.alpha
            self._seconds = self._seconds * keep + max(seconds - (self.overhead or 0.0),
                                                       seconds / 2)
            self._tokens = self._tokens * keep + tokens

    def seconds(self, tokens: int) -> float:
        return tokens * self.per_token


@dataclass(frozen=True, slots=True)
class Estimate:
    """A restore's figures and the decision they make."""

    tokens: int  # prompt tokens the restore saves computing
    missing_bytes: int  # what the machine cache lacks, fetched from the store
    missing_blobs: int
    cached_bytes: int  # in the machine cache: verified and copied only
    restore_s: float | None  # None: the store's speed is not measured yet
    prefill_s: float
    when: str
    overhead_s: float = 0.0  # measured besides the bytes, included in restore_s
    probe: bool = False  # slower only by its overhead, restored to measure that again

    @property
    def faster(self) -> bool:
        """Whether the figures alone make the restore clearly faster than computing."""
        return self.restore_s is None or self.restore_s <= RESTORE_MARGIN * self.prefill_s

    @property
    def restores(self) -> bool:
        return self.when == "always" or self.probe or self.faster

    def describe(self) -> str:
        restore = "unknown" if self.restore_s is None else f"{self.restore_s:.4f} s"
        return (f"restore {restore} ({self.missing_bytes} bytes in {self.missing_blobs} "
                f"blobs from the store, {self.cached_bytes} cached, {self.overhead_s:.4f} s "
                f"overhead) vs prefill {self.prefill_s:.4f} s ({self.tokens} tokens)"
                + ("; restored to measure the overhead again" if self.probe else ""))


class RestoreCost:
    """The estimator an engine integration holds: the store's and the engine's measured
    speeds, and the decision for each restore (thread-safe)."""

    def __init__(self, when: str = "faster",
                 prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
                 local_bytes_per_s: float = LOCAL_BYTES_PER_S,
                 probe_interval: float = PROBE_INTERVAL_S,
                 fetch_threads: int | None = None) -> None:
        self.when = check_restore_when(when)
        # blobs a restore fetches at once (kvgraft.integrations.prefetch, a graft's load)
        self.fetch_threads = fetch_threads or transfer_workers()
        self.store = StoreSpeed()
        self.prefill = PrefillSpeed(prefill_tokens_per_s)
        self.local_bytes_per_s = local_bytes_per_s
        self.probe_interval = probe_interval
        self.lookup_s: float | None = None  # measured seconds a lookup takes (the median)
        self._lookups: deque[float] = deque(maxlen=LOOKUP_WINDOW)
        self.overhead_s: float | None = None  # measured seconds a restore costs besides
        self._restores = 0  # restores passed over, up to RESTORE_FIRST
        self._restored_at: float | None = None  # time.monotonic() of the last measured one
        self._overhead_turns = _Turns()  # restores let through to measure the overhead
        self._looked_up_at: float | None = None  # time.monotonic() of the last lookup
        self._lookup_turns = _Turns()  # lookups let through the gate to measure it
        self._probe_turns = _Turns()  # skipped restores fetched to measure the store
        self._lock = threading.Lock()

    def observe_lookup(self, seconds: float) -> None:
        """A lookup (the catalog match every prompt looked up pays) took `seconds`."""
        if seconds >= 0:
            with self._lock:
                self._lookups.append(seconds)
                self.lookup_s = statistics.median_low(self._lookups)
                self._looked_up_at = time.monotonic()

    def observe_restore(self, seconds: float, estimate: Estimate, computed_tokens: int = 0,
                        ) -> None:
        """A restore decided on `estimate` took `seconds` until its KV was in place and the
        `computed_tokens` after it computed: what that leaves beyond the estimate of its
        bytes and of those tokens is its overhead (never below 0), once the process's
        first `RESTORE_FIRST` restores are past."""
        if estimate.restore_s is None or not seconds >= 0:
            return
        beside = (estimate.restore_s - estimate.overhead_s
                  + self.prefill.seconds(computed_tokens))
        with self._lock:
            if self._restores < RESTORE_FIRST:
                self._restores += 1
                return
            self.overhead_s = _ewma(self.overhead_s, max(0.0, seconds - beside), ALPHA)
            self._restored_at = time.monotonic()

    def lookup_pays(self, tokens: int) -> bool:
        """Whether to look up a prompt whose lookup could save computing `tokens`."""
        lookup = self.lookup_s
        if (self.when == "always" or lookup is None or len(self._lookups) < LOOKUP_FIRST
                or lookup <= LOOKUP_SHARE * self.prefill.seconds(tokens)):
            return True
        with self._lock:  # one now and then measures the lookup again
            return self._lookup_turns.take(self.probe_interval, self._looked_up_at)

    def estimate(self, tokens: int, missing: Iterable[int], cached_bytes: int) -> Estimate:
        """The restore of `tokens` prompt tokens from blobs of sizes `missing` the machine
        cache lacks and `cached_bytes` it holds; one the measured overhead alone makes
        slower is a probe now and then (a turn taken: act on the estimate)."""
        sizes = list(missing)
        nbytes = sum(sizes)
        fetch = self.store.seconds(nbytes, fetch_rounds(len(sizes), self.fetch_threads))
        local = (nbytes + cached_bytes) / self.local_bytes_per_s
        overhead = self.overhead_s or 0.0
        estimate = Estimate(tokens, nbytes, len(sizes), cached_bytes,
                            None if fetch is None else fetch + local + overhead,
                            self.prefill.seconds(tokens), self.when, overhead)
        if estimate.restores or estimate.restore_s is None or not overhead:
            return estimate
        without = replace(estimate, restore_s=estimate.restore_s - overhead, overhead_s=0.0)
        if not without.faster:
            return estimate
        with self._lock:  # a prompt that computes measures no overhead: one now and then
            due = (self._restored_at is not None
                   and self._overhead_turns.take(self.probe_interval, self._restored_at))
        return replace(estimate, probe=True) if due else estimate

    def probe_due(self) -> bool:
        """Whether a skipped restore's blobs should be fetched in the background now (at
        most once per `probe_interval`, and not while fetches keep being measured)."""
        with self._lock:
            return self._probe_turns.take(self.probe_interval, self.store.observed_at)

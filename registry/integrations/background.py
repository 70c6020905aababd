"""A bounded queue of jobs run by one daemon thread, off an engine's request path (the vLLM
connector, the llama.cpp prompt cache).

Publishing a graft (encoding, hashing, uploading, one catalog transaction) and writing audit
events never run on a scheduling or forward step: they are queued here. When the queue is
full the job is dropped, counted and logged: a dropped publish is only a future cache miss,
and the engine never waits for the registry.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable


class Counters:
    """Thread-safe event counters (restores, fallbacks by reason, publishes, drops), and
    timings vLLM's metrics take as samples (drained by kvgraft.integrations.vllm.stats)."""

    MAX_SAMPLES = 10_000  # per name, between two drains: beyond, the oldest go

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self._samples: dict[str, list[float]] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            kept = self._samples.setdefault(name, [])
            kept.append(value)
            del kept[: -self.MAX_SAMPLES]

    def drain_samples(self) -> dict[str, list[float]]:
        with self._lock:
            out, self._samples = self._samples, {}
            return out

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


class Background:
    def __init__(self, name: str, size: int, counters: Counters,
                 logger: logging.Logger | None = None) -> None:
        self._log = logger or logging.getLogger("kvgraft.integrations")
        self._q: queue.Queue[tuple[str, Callable[[], object]] | None] = queue.Queue(size)
        self._counters = counters
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, kind: str, job: Callable[[], object]) -> bool:
        try:
            self._q.put_nowait((kind, job))
        except queue.Full:
            self._counters.add(f"dropped.{kind}")
            self._log.warning("kvgraft: %s queue full, dropped one %s job", self._thread.name,
                              kind)
            return False
        self._counters.add(f"queued.{kind}")
        return True

    def _run(self) -> None:
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                kind, job = item
                try:
                    job()
                except Exception as e:  # a failed job must not stop the ones behind it
                    self._counters.add(f"failed.{kind}")
                    self._log.warning("kvgraft: %s job failed: %s", kind, e)
            finally:
                self._q.task_done()

    def close(self, timeout: float) -> None:
        """Run what is queued (up to `timeout` seconds), then stop."""
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

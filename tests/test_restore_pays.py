"""A restore happens only when it pays, on the real engines, with the store behind a
throttled link: a real S3 server on loopback reached through tests/support/throttle.py.

llama.cpp (SmolLM2-135M): one process publishes a short and two long prompts straight to
the bucket; another machine cache restores through the link. The engine's prefill rate
and the store's speed are measured from what the cache does, then each prompt's time to
first token is taken with the decision on (`restore_when = "faster"`) beside computing it
(printed with -s: figures, not assertions, since they move with the machine's load). On a
fast link (125 MB/s, as the 1 Gbit/s link of benchmarks/s3link.py) the long prompts
restore; against an engine whose prefill costs nothing, nothing restores and each skip is
counted.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from kvgraft.catalog import Catalog
from kvgraft.client import Registry
from kvgraft.config import Config
from tests.support.daemons import ensure_s3
from tests.support.throttle import Throttle
from tests.test_llamacpp import DOC, QUESTION, smollm2_gguf

# after the import above, which skips the module without llama-cpp-python
from kvgraft.integrations.llamacpp.cache import CacheSettings, RegistryCache  # isort: skip

REPO = "prompts/pays"
LATENCY = 0.05  # seconds the link adds to each response (a WAN-like round trip)


@pytest.fixture(scope="module")
def bucket() -> Iterator[tuple[str, tuple[str, int]]]:
    """(blob URL of a fresh prefix, the S3 server's host and port)."""
    s3 = ensure_s3()
    if s3 is None:
        pytest.skip("no S3 server on loopback")
    endpoint = urlparse(os.environ.get("AWS_ENDPOINT_URL_S3", ""))
    if not endpoint.hostname or not endpoint.port:
        pytest.skip("the S3 server's endpoint is not on this machine")
    yield f"{s3}/{uuid.uuid4().hex}", (endpoint.hostname, endpoint.port)


def registry(root: Path, name: str, blob_url: str) -> Registry:
    home = root / name
    return Registry(Config(home=home, catalog_url=f"sqlite:///{root / 'catalog.db'}",
                           blob_url=blob_url, cache_dir=home / "cache"))


def ttft(lm: Any, cache: RegistryCache | None, ids: list[int]) -> float:
    lm.llm.reset()
    lm.llm.set_cache(cache)
    t0 = time.perf_counter()
    lm.llm.create_completion(ids, max_tokens=1, temperature=0.0)
    return time.perf_counter() - t0


@pytest.mark.slow
def test_llamacpp_restores_only_when_it_pays(tmp_path: Path, bucket: tuple[str, tuple[str, int]],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgraft.integrations.llamacpp import Settings, load_model
    from kvgraft.integrations.llamacpp.graft import prefill

    blob_url, (host, port) = bucket
    Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", auto_upgrade=True).close()
    pub = registry(tmp_path, "publisher", blob_url)
    lm = load_model(smollm2_gguf(), cache_dir=pub.config.cache_dir,
                    settings=Settings(threads=2))
    doc = lm.tokenize(DOC)
    words = lm.tokenize(" ".join(f"note {i}: the lamp, the wick, the oil." for i in range(400)),
                        special=False)
    question = lm.tokenize(QUESTION, special=False)
    prefixes = {"short": doc[:24], "probe": doc[:8] + words[:700],
                "long-a": doc[:16] + words[700:1400], "long-b": doc[:12] + words[1400:2100]}
    warm = doc[:20] + words[2100:2400] + question  # never published: computed
    publisher = RegistryCache(pub, lm, repository=REPO)
    for ids in prefixes.values():
        lm.llm.reset()
        prefill(lm, ids)
        publisher[ids] = lm.llm.save_state()
    publisher.close()
    assert publisher.counters.snapshot()["published"] == len(prefixes)
    pub.close()
    prompts = {name: ids + question for name, ids in prefixes.items()}

    # computing each prompt: the better of two runs
    base = {name: min(ttft(lm, None, ids) for _ in range(2)) for name, ids in prompts.items()}

    figures: list[str] = []
    for rate, label in ((10e6, "10 MB/s"), (125e6, "125 MB/s")):
        with Throttle(host, port, bytes_per_s=rate, latency=LATENCY) as link:
            monkeypatch.setenv("KVGRAFT_S3_ENDPOINT_URL", link.url)
            reg = registry(tmp_path, f"consumer-{int(rate)}", blob_url)
            cache = RegistryCache(reg, lm, repository=REPO, settings=CacheSettings(
                REPO, publish=False, lookup_timeout=60.0, min_tokens=8))
            ttft(lm, cache, warm)  # measures the prefill rate
            ttft(lm, cache, prompts["probe"])  # the store's speed is unknown: restores
            assert cache.cost.prefill.measured and cache.cost.store.latency is not None
            got: dict[str, float] = {}
            decided: dict[str, str] = {}
            for name in ("short", "long-a", "long-b"):
                times = []
                for _ in range(2):
                    reg.cache.prune(everything=True)  # each run with a cold machine cache
                    before = cache.counters.snapshot()
                    times.append(ttft(lm, cache, prompts[name]))
                    after = cache.counters.snapshot()
                    decided[name] = ("restored" if after.get("hits", 0) > before.get("hits", 0)
                                     else "computed")
                got[name] = min(times)
                figures.append(f"llama.cpp {label}: {name} ({len(prompts[name])} tokens) "
                               f"{decided[name]}: TTFT {got[name]:.3f} s vs computing "
                               f"{base[name]:.3f} s ({got[name] / base[name]:.2f}x)")
            store, prefill_rate = cache.cost.store, cache.cost.prefill.tokens_per_s
            figures.append(f"llama.cpp {label}: store measured {store.bytes_per_s or 0:.3g} "
                           f"B/s, {store.latency or 0:.4f} s a request; prefill "
                           f"{prefill_rate:.0f} tokens/s; lookup {cache.cost.lookup_s or 0:.4f} "
                           f"s; counters {cache.counters.snapshot()}")
            print("\n" + "\n".join(figures[-4:]), flush=True)
            if rate > 100e6:
                assert decided["long-a"] == decided["long-b"] == "restored", figures
                # an engine that computes faster than any store answers: nothing restores;
                # with a prefill that costs nothing the lookup itself is not made
                for prefill_s, lookup_s, skipped in ((1e-4, 0.0, "skipped.slower"),
                                                     (0.0, 1e-3, "skipped.short")):
                    reg.cache.prune(everything=True)
                    monkeypatch.setattr(cache.cost.prefill, "seconds",
                                        lambda tokens, s=prefill_s: s)
                    cache.cost.lookup_s = lookup_s
                    before = cache.counters.snapshot()
                    ttft(lm, cache, prompts["long-a"])
                    after = cache.counters.snapshot()
                    assert after.get("hits", 0) == before.get("hits", 0), after
                    assert after.get(skipped, 0) == before.get(skipped, 0) + 1, (skipped, after)
            reg.close()

"""Bringing a graft's blobs into the machine cache ahead of a restore, each fetch from the
store timed for the restore-cost estimate (kvgraft.integrations.restorecost): what the vLLM
connector and the llama.cpp prompt cache share."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvgraft.client import Registry
from kvgraft.formats.manifest import BlobRef
from kvgraft.integrations.restorecost import fetch_rounds
from kvgraft.transfer.pull import Fetcher, transfer_workers

Observe = Callable[[int, int, float], None]  # (bytes, rounds, seconds) of a store fetch


def split_cached(registry: Registry, refs: Sequence[BlobRef]) -> tuple[list[BlobRef], int]:
    """(the blobs the machine cache lacks, bytes of those it holds)."""
    lacking = [r for r in refs if not registry.cache.has(r.digest)]
    return lacking, sum(r.size for r in refs) - sum(r.size for r in lacking)


def prefetch(registry: Registry, refs: Sequence[BlobRef], observe: Observe | None = None, *,
             keep_decoded: bool = False) -> int:
    """Fetch the blobs the machine cache lacks, each verified, `fetch_threads` at a time (as
    a graft's load fetches them); bytes fetched from the store. `observe(size, rounds,
    seconds)` measures the whole fetch: the decoded size of the blobs fetched (as an
    estimate counts them) and how many rounds of requests that took (`fetch_rounds`);
    `keep_decoded` keeps compressed blobs decoded in the cache."""
    fetcher = Fetcher(registry.store, registry.cache, keep_decoded=keep_decoded)
    lacking = [r for r in refs if not registry.cache.has(r.digest)]
    if not lacking:
        return 0
    threads = transfer_workers()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(threads, len(lacking)),
                            thread_name_prefix="kvgraft-prefetch") as pool:
        got = list(pool.map(lambda ref: fetcher.get(ref)[1], lacking))
    seconds = time.perf_counter() - t0
    fetched = [ref for ref, n in zip(lacking, got, strict=True) if n]
    if fetched and observe is not None:
        observe(sum(r.size for r in fetched), fetch_rounds(len(fetched), threads), seconds)
    return sum(got)

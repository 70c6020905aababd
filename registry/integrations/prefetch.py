"""Bringing a graft's blobs into the machine cache ahead of a restore, each fetch from the
store timed for the restore-cost estimate (kvgraft.integrations.restorecost): what the vLLM
connector and the llama.cpp prompt cache share."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvgraft.client import Registry
from kvgraft.formats.manifest import BlobRef
from kvgraft.transfer.pull import Fetcher

Observe = Callable[[int, int, float], None]  # (bytes, requests, seconds) of a store fetch


def split_cached(registry: Registry, refs: Sequence[BlobRef]) -> tuple[list[BlobRef], int]:
    """(the blobs the machine cache lacks, bytes of those it holds)."""
    lacking = [r for r in refs if not registry.cache.has(r.digest)]
    return lacking, sum(r.size for r in refs) - sum(r.size for r in lacking)


def prefetch(registry: Registry, refs: Sequence[BlobRef], observe: Observe | None = None, *,
             keep_decoded: bool = False) -> int:
    """Fetch the blobs the machine cache lacks, each verified; bytes fetched from the store.
    `observe(size, 1, seconds)` measures each fetch (its decoded size, as an estimate
    counts it); `keep_decoded` keeps compressed blobs decoded in the cache."""
    fetcher = Fetcher(registry.store, registry.cache, keep_decoded=keep_decoded)
    fetched = 0
    for ref in refs:
        if not registry.cache.has(ref.digest):
            t0 = time.perf_counter()
            got = fetcher.get(ref)[1]
            if got and observe is not None:
                observe(ref.size, 1, time.perf_counter() - t0)
            fetched += got
    return fetched

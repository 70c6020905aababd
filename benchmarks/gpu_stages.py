"""The measurements of benchmarks/gpu.py: the machine's ceilings, a restore taken apart
stage by stage, and the time to the first token with and without a graft.

Every figure is a rate over the bytes of the KV file (decoded) unless it says `stored`;
GB is 10^9 bytes. Device work is synchronised before a clock is read.
"""

from __future__ import annotations

import hashlib
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

T = TypeVar("T")


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("inf")


def timed(fn: Callable[[], T], device: Any = None) -> tuple[T, float]:
    from kvgraft.integrations.transformers.device import synchronize

    if device is not None:
        synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device is not None:
        synchronize(device)
    return out, time.perf_counter() - t0


def best(fn: Callable[[], object], reps: int, device: Any = None) -> float:
    """The median of `reps` timed calls (after the one that warms caches and kernels)."""
    fn()
    return statistics.median(timed(fn, device)[1] for _ in range(reps))


def ceilings(device: Any, workers: int, nbytes: int) -> dict[str, Any]:
    """What the machine itself does with `nbytes`: SHA-256 on one core and on `workers`
    threads, a host memory copy, and (on CUDA) the host-to-device copy from pinned and
    from pageable memory."""
    import numpy as np
    import torch

    host = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    view = host.data
    step = -(-nbytes // workers)
    parts = [view[i : i + step] for i in range(0, nbytes, step)]
    out: dict[str, Any] = {"bytes": nbytes, "workers": workers}
    out["sha256_1core_gbps"] = gbps(nbytes, best(lambda: hashlib.sha256(view).digest(), 2))
    with ThreadPoolExecutor(workers) as pool:
        def all_cores() -> None:
            list(pool.map(lambda m: hashlib.sha256(m).digest(), parts))
        out["sha256_all_gbps"] = gbps(nbytes, best(all_cores, 3))
    out["host_memcpy_gbps"] = gbps(nbytes, best(_copier(host), 3))
    if torch.device(device).type == "cuda":
        pageable = torch.from_numpy(host)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(pageable)
        on = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out["h2d_pinned_gbps"] = gbps(nbytes, best(lambda: on.copy_(pinned, non_blocking=True),
                                                   5, device))
        out["h2d_pageable_gbps"] = gbps(nbytes, best(lambda: on.copy_(pageable), 3, device))
        out["d2h_pinned_gbps"] = gbps(nbytes, best(lambda: pinned.copy_(on, non_blocking=True),
                                                   5, device))
    return out


def _copier(host: Any) -> Callable[[], None]:
    import numpy as np

    dst = np.empty_like(host)
    return lambda: np.copyto(dst, host)


def stages(registry: Any, lm: Any, ref: str, workers: int, workdir: Path) -> dict[str, Any]:
    """A restore taken apart: reading the stored blobs from the local store, decoding
    them, verifying them (SHA-256), the whole cold read (which also assembles the file and
    keeps it in the machine cache), reading that cached file, the warm read (map + verify
    every tensor), and the copy of the tensors to the model's device."""
    from kvgraft.transfer.cache import Cache
    from kvgraft.transfer.pull import Fetcher

    opened = registry.open(ref, model=lm.fingerprint.identity)
    manifest = opened.manifest
    out: dict[str, Any] = {"kv_bytes": manifest.file_size, "blobs": len(manifest.blobs()),
                           "workers": workers}
    out.update(_store_stages(opened.fetcher.store, manifest, workers))
    cold = Fetcher(opened.fetcher.store, Cache(workdir / "stage-cache"))
    try:
        out.update(_cache_stages(cold, manifest, workers, lm.device))
    finally:
        shutil.rmtree(cold.cache.root, ignore_errors=True)
    return out


def _store_stages(store: Any, manifest: Any, workers: int) -> dict[str, Any]:
    from kvgraft.codecs.codec import decode_blob, max_stored_size
    from kvgraft.digest import Digest

    blobs, size = manifest.blobs(), manifest.file_size
    out: dict[str, Any] = {}
    with ThreadPoolExecutor(workers) as pool:
        stored, s = timed(lambda: list(pool.map(
            lambda b: store.get(b.digest, max_stored_size(b.size)), blobs)))
        out["stored_bytes"] = sum(len(x) for x in stored)
        out["codecs"] = _codecs(stored)
        out["read_store_gbps"] = gbps(size, s)
        decoded, s = timed(lambda: list(pool.map(
            lambda p: decode_blob(p[0], p[1].size)[1], zip(stored, blobs, strict=True))))
        out["decode_gbps"] = gbps(size, s)
        _, s = timed(lambda: list(pool.map(Digest.of, decoded)))
        out["verify_gbps"] = gbps(size, s)
    return out


def _cache_stages(fetcher: Any, manifest: Any, workers: int, device: Any) -> dict[str, Any]:
    from kvgraft.integrations.transformers.device import to_device
    from kvgraft.transfer.materialise import read_kv

    size = manifest.file_size
    out: dict[str, Any] = {}
    _, s = timed(lambda: read_kv(manifest, fetcher, workers=workers))
    out["cold_read_gbps"] = gbps(size, s)
    into = bytearray(size + 64)
    with fetcher.cache.blobs.open(manifest.file_digest) as f:
        _, s = timed(lambda: cast(Any, f).readinto(into))
    out["read_machine_cache_gbps"] = gbps(size, s)
    (layout, buf, base), s = timed(lambda: read_kv(manifest, fetcher, workers=workers))
    out["warm_read_verify_gbps"] = gbps(size, s)
    spans = [(base + t.begin, t.nbytes) for li in layout.layers for t in (li.key, li.value)]
    moved = sum(n for _, n in spans)
    out["copied_bytes"] = moved
    out["copy_pinned_staged_gbps"] = gbps(moved, best(lambda: to_device(buf, spans, device),
                                                      2, device))
    out["copy_pageable_gbps"] = gbps(moved, best(lambda: _pageable(buf, spans, device), 2,
                                                 device))
    return out


def _codecs(stored: Sequence[Any]) -> list[str]:
    from kvgraft.codecs.codec import parse_frame

    return sorted({parse_frame(memoryview(x))[0] for x in stored})


def _pageable(buf: Any, spans: Sequence[tuple[int, int]], device: Any) -> list[Any]:
    import torch

    return [torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=b).to(device)
            for b, n in spans]


def cold(registry_at: Callable[[str], Any], name: str, fn: Callable[[Any], T]) -> T:
    """`fn(registry)` with a machine cache of its own, removed afterwards (a cold cache
    per run; at 32k tokens each holds 4.3 GB)."""
    reg = registry_at(name)
    try:
        return fn(reg)
    finally:
        reg.close()
        shutil.rmtree(reg.config.cache_dir, ignore_errors=True)


def restore(registry_at: Callable[[str], Any], lm: Any, ref: str, size: int, workers: int,
            reps: int) -> dict[str, Any]:
    """load_graft end to end (policy, manifest, read, verify, copy to the device, the
    transformers cache built), from the local store into an empty machine cache (cold)
    and from the machine cache (warm)."""
    from kvgraft.integrations.transformers import load_graft

    def once(reg: Any) -> float:
        return timed(lambda: load_graft(ref, lm, registry=reg, workers=workers).cache(),
                     lm.device)[1]

    cold_s = [cold(registry_at, f"restore-cold-{i}", once) for i in range(reps)]
    warm_s = cold(registry_at, "restore-warm",
                  lambda reg: [once(reg) for _ in range(reps + 1)][1:])
    cold_m, warm_m = statistics.median(cold_s), statistics.median(warm_s)
    return {"cold_s": round(cold_m, 4), "cold_gbps": gbps(size, cold_m),
            "warm_s": round(warm_m, 4), "warm_gbps": gbps(size, warm_m)}


def ttft(registry_at: Callable[[str], Any], lm: Any, ref: str, ids: Sequence[int],
         suffix: Sequence[int], workers: int, reps: int) -> dict[str, Any]:
    """Seconds to the first token of prefix + suffix: prefilling it all, against
    restoring the prefix's graft (warm: from the machine cache; cold: from the local
    store) and feeding only the suffix."""
    from transformers import DynamicCache

    from kvgraft.integrations.transformers import load_graft
    from kvgraft.integrations.transformers.generate import greedy

    def prefill() -> int:
        return greedy(lm, DynamicCache(config=lm.model.config), [*ids, *suffix], 0)[0].token

    def grafted(reg: Any) -> Callable[[], int]:
        def run() -> int:
            graft = load_graft(ref, lm, registry=reg, workers=workers)
            return greedy(lm, graft.cache(len(ids)), suffix, 0)[0].token
        return run

    tokens: dict[str, int] = {}

    def clock(name: str, fn: Callable[[], int]) -> float:
        tokens[name], s = timed(fn, lm.device)
        return s

    prefill()  # kernels and allocator warmed at this length
    pre = [clock("prefill", prefill) for _ in range(reps)]
    cold_s = [cold(registry_at, f"ttft-cold-{i}", lambda r: clock("graft_cold", grafted(r)))
              for i in range(reps)]
    warm = cold(registry_at, "ttft-warm",
                lambda r: [clock("graft_warm", grafted(r)) for _ in range(reps + 1)][1:])
    p, w, c = (statistics.median(x) for x in (pre, warm, cold_s))
    return {"prefix_tokens": len(ids), "suffix_tokens": len(suffix), "reps": reps,
            "prefill_s": round(p, 4), "graft_warm_s": round(w, 4), "graft_cold_s": round(c, 4),
            "speedup_warm": round(p / w, 2), "speedup_cold": round(p / c, 2),
            "first_tokens": tokens}

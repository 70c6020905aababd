"""Push and pull of a synthetic BF16 KV file through the local store, next to a baseline
measured in the same run: the same bytes through plain hashlib.sha256 + zstandard (same
level) in one pass. Each measurement runs in its own process so its peak RSS is its own.
A further row puts the push of today's manifest (version 2: each byte hashed once) next to
a push writing a version 1 manifest (the file, each tensor and each chunk hashed), with the
client CPU seconds per GB of each.

    python -m benchmarks.core [--size-mib 1024] [--workdir .bench]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zstandard

LEVEL = 1
BLOCK = 4 << 20
# SmolLM2-135M's KV shape: 30 layers, 3 KV heads, head_dim 64 → 23,040 bytes per token in BF16.
LAYERS, HEADS, DIM = 30, 3, 64


def kv_file(workdir: Path, size_mib: int) -> Path:
    """The benchmark input, written once per size and reused."""
    from tests.support.synthetic import write_synthetic

    path = workdir / f"bench-{size_mib}MiB-bf16.kv"
    if not path.exists():
        tokens = size_mib * (1 << 20) // (LAYERS * HEADS * DIM * 2 * 2)
        write_synthetic(path, num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, tokens=tokens,
                        dtype="BF16", seed=42, name="bench")
    return path


def peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes.

    Read from /proc rather than getrusage: a child's ru_maxrss starts from its parent's RSS
    at fork, which would charge the parent's memory to every measurement."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _child(argv: list[str]) -> tuple[dict[str, Any], int]:
    """Run one measurement in a fresh process; returns its JSON result and peak RSS (bytes)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.core", "--child", *argv],
                          stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {argv} failed with {proc.returncode}")
    result = json.loads(proc.stdout)
    return result, result.pop("peak_rss")


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


Measured = tuple[dict[str, Any], int, dict[str, Any], int]


def ratio_rows(bench: str, size: int, measured: dict[str, Measured],
               extra: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per operation: kvgraft next to its baseline from the same run.

    `measured` maps an operation to (ours, our peak RSS, baseline, baseline peak RSS); each
    result has the "seconds" it took."""
    mb = size / 1e6
    return [{
        "bench": f"{bench} {op}", "size_mib": round(size / 2**20),
        "kvgraft_MBps": round(mb / ours["seconds"], 1),
        "baseline_MBps": round(mb / base["seconds"], 1),
        "ratio": round(base["seconds"] / ours["seconds"], 2),
        **extra,
        "peak_rss_MB": round(ours_rss / 1e6), "baseline_peak_rss_MB": round(base_rss / 1e6),
        # Where each side was measured several times, "seconds" is their median.
        **({"kvgraft_rounds_s": ours["rounds"], "baseline_rounds_s": base["rounds"]}
           if "rounds" in ours else {}),
    } for op, (ours, ours_rss, base, base_rss) in measured.items()]


def baseline_push(src: Path, dst: Path) -> dict[str, Any]:
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    h = hashlib.sha256()
    t0 = time.perf_counter()
    with open(src, "rb") as f, open(dst, "wb") as out:
        writer = cctx.stream_writer(out, closefd=False)
        while block := f.read(BLOCK):
            h.update(block)
            writer.write(block)
        writer.flush(zstandard.FLUSH_FRAME)
    return {"seconds": time.perf_counter() - t0, "stored": dst.stat().st_size}


def baseline_pull(src: Path, dst: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    t0 = time.perf_counter()
    with open(src, "rb") as f, open(dst, "wb") as out:
        reader = zstandard.ZstdDecompressor().stream_reader(f)
        while block := reader.read(BLOCK):
            h.update(block)
            out.write(block)
    return {"seconds": time.perf_counter() - t0}


def _registry(home: Path, cache: Path) -> Any:
    from kvgraft.client import Registry
    from kvgraft.config import Config

    return Registry(Config.from_env({"KVGRAFT_HOME": str(home), "KVGRAFT_CACHE": str(cache)}))


WARM_ENV = "BENCH_WARM_BYTES"


def warm_env(kv_size: int) -> dict[str, str]:
    """The environment that has a measurement child warm `warm_memory` for a transfer of a
    KV file of `kv_size` bytes: the file written out, the machine cache's copy and the
    buffers, with room to spare."""
    return {WARM_ENV: str(2 * kv_size + (512 << 20))}


def warm_memory() -> None:
    """Touch and free the bytes $BENCH_WARM_BYTES names, just before a timed region.

    On a VM whose balloon reports free pages to the host (virtio-balloon free page
    reporting, as on the 2-core machine kinds of docs/benchmarks.md), memory the guest freed
    more than about 2 seconds ago has been handed back: touching it again costs a host fault
    and the page's zeroing. A transfer writes its output into new page cache, so it paid
    that per 4 KiB page: writing 1 GiB into a new file took 2.4 CPU s there against 0.2 s
    into memory freed a moment before, and a pull's client CPU read 5.0-5.4 s/GB or 3.2-3.5
    depending on which it met. Touched here and freed, those pages are the ones the
    measurement's page cache and buffers are built from, so both sides are measured on
    memory the guest holds, as on a machine without that balloon."""
    nbytes = int(os.environ.get(WARM_ENV, "0"))
    if nbytes:
        block = b"\x01" * nbytes  # written, so every page is faulted in
        del block  # unmapped at once: back to the free lists, not yet reported
        # The measurement's peak RSS (VmHWM) starts again from here (Linux: "5" resets it).
        Path("/proc/self/clear_refs").write_text("5")


def warm_imports() -> None:
    """Import what a transfer imports on its first use (NumPy, zstandard, jsonschema for
    the manifest: ~0.2 CPU s and, as the modules stay, a full collection of the cyclic GC,
    once per process), before a timed region, as the baselines' boto3 clients have
    imported theirs by then: the rows are per GB moved, and `benchmarks.startup` measures
    what a process pays before its first byte."""
    import kvgraft.formats.manifest
    import kvgraft.transfer.pull
    import kvgraft.transfer.push  # noqa: F401


def client_cpu() -> float:
    """CPU seconds (user + system, every thread) this process has used so far."""
    t = os.times()
    return t.user + t.system


def kvgraft_push(src: Path, home: Path, version: str = "2") -> dict[str, Any]:
    from kvgraft.transfer.push import PushOptions

    reg = _registry(home, home / "cache")
    reg.catalog  # noqa: B018  (open and migrate the catalog outside the timed region)
    warm_imports()
    t0, c0 = time.perf_counter(), client_cpu()
    result = reg.push(src, "bench/kv:1", options=PushOptions(level=LEVEL, version=int(version)))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "cpu": client_cpu() - c0, "stored": result.stored_size,
            "digest": str(result.digest)}


def kvgraft_pull(home: Path, cache: Path, out: Path) -> dict[str, Any]:
    reg = _registry(home, cache)
    reg.catalog  # noqa: B018
    warm_imports()
    t0 = time.perf_counter()
    result = reg.pull("bench/kv:1", out)
    return {"seconds": time.perf_counter() - t0, "fetched": result.stats.fetched}


CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "baseline-push": lambda a, b: baseline_push(Path(a), Path(b)),
    "baseline-pull": lambda a, b: baseline_pull(Path(a), Path(b)),
    "kvgraft-push": lambda a, b, v="2": kvgraft_push(Path(a), Path(b), v),
    "kvgraft-pull": lambda a, b, c: kvgraft_pull(Path(a), Path(b), Path(c)),
}


def run(workdir: Path, size_mib: int, report: Callable[[dict[str, Any]], None]) -> Path:
    """Measure push and pull; returns the KV file so other benchmarks can reuse it."""
    workdir.mkdir(parents=True, exist_ok=True)
    src = kv_file(workdir, size_mib)
    size = src.stat().st_size
    scratch = workdir / "core"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    base_push, base_push_rss = _child(["baseline-push", str(src), str(scratch / "base.zst")])
    push, push_rss = _child(["kvgraft-push", str(src), str(scratch / "home")])
    base_pull, base_pull_rss = _child(["baseline-pull", str(scratch / "base.zst"),
                                       str(scratch / "base.out")])
    pull, pull_rss = _child(["kvgraft-pull", str(scratch / "home"), str(scratch / "cache"),
                             str(scratch / "pulled.kv")])
    if sha256_file(src) != sha256_file(scratch / "pulled.kv"):
        raise RuntimeError("pulled file differs from the pushed one")
    for row in ratio_rows("local", size, {
            "push": (push, push_rss, base_push, base_push_rss),
            "pull": (pull, pull_rss, base_pull, base_pull_rss)},
            {"compression": round(size / push["stored"], 3),
             "baseline_compression": round(size / base_push["stored"], 3)}):
        report(row)
    shutil.rmtree(scratch / "cache", ignore_errors=True)
    push_v1, push_v1_rss = _child(["kvgraft-push", str(src), str(scratch / "home-v1"), "1"])
    row = ratio_rows("local push, manifest version", size,
                     {"2 vs 1": (push, push_rss, push_v1, push_v1_rss)}, {})[0]
    row["kvgraft_client_cpu_s_per_GB"] = round(push["cpu"] / (size / 1e9), 2)
    row["baseline_client_cpu_s_per_GB"] = round(push_v1["cpu"] / (size / 1e9), 2)
    row["baseline"] = "the same push writing a version 1 manifest"
    report(row)
    return src


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        result = CHILDREN[sys.argv[2]](*sys.argv[3:])
        print(json.dumps({**result, "peak_rss": peak_rss()}))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    args = parser.parse_args()
    run(args.workdir, args.size_mib, lambda row: print(json.dumps(row), flush=True))


if __name__ == "__main__":
    main()

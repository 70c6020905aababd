"""Push and pull of a KV file through S3 (SeaweedFS `weed mini` on loopback), each next to a
baseline measured in the same run: plain boto3 `upload_file` / `download_file` (default
TransferConfig: 8 MiB multipart parts, 10 threads) of the same compressed bytes, namely the
artifact's stored blobs concatenated into one file. Every measurement runs in its own
process, so its peak RSS (VmHWM) is its own; its clock starts once its client is made and
what a transfer imports on first use is imported (`benchmarks.core.warm_imports`).

Loopback S3 on a small machine is noisy (the server shares the cores, and one transfer's
timing depends on what the page cache and the server did just before), so each side is
measured `rounds` times, alternating which goes first, and the rows give the median of each
(every round's seconds are in the row too). Each kvgraft push round pushes into an empty
prefix, so every round uploads every blob.

    run(workdir, kv_file, report, rounds=3) -> None
        workdir: scratch directory (a server data dir and catalogs are made under it);
        kv_file: the KV file to push (e.g. benchmarks.core.kv_file(workdir, 1024));
        report:  called with one dict per row ("s3 push", "s3 pull"): MB/s of the KV file
                 size for kvgraft and the baseline (medians), their ratio (>1: kvgraft
                 faster), the highest peak RSS of each, compression.

    python -m benchmarks.s3 [--size-mib 1024] [--workdir .bench] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.core import (
    client_cpu,
    ratio_rows,
    sha256_file,
    warm_env,
    warm_imports,
    warm_memory,
)

BUCKET = "bench"
PREFIX = "kv"
BASELINE_KEY = "baseline/blobs.bin"
RAW_KEY = "baseline/raw.kv"


def _group_stats(pgid: int) -> list[tuple[int, list[str]]]:
    """(pid, /proc/PID/stat fields after the command name) of the processes of group
    `pgid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid:  # fields[0] is the state (field 3 of stat)
            found.append((int(stat.parent.name), fields))
    return found


def server_cpu(pgid: int) -> float:
    """CPU seconds used so far by the processes of group `pgid` (the S3 server): utime +
    stime."""
    total = sum(int(f[11]) + int(f[12]) for _, f in _group_stats(pgid))
    return total / os.sysconf("SC_CLK_TCK")


def _registry(home: Path, cache: Path, prefix: str) -> Any:
    from kvgraft.client import Registry
    from kvgraft.config import Config

    # The catalog is the embedded SQLite one under home; the blobs go to the bucket.
    return Registry(Config.from_env({"KVGRAFT_HOME": str(home), "KVGRAFT_CACHE": str(cache),
                                     "KVGRAFT_BLOB_URL": f"s3://{BUCKET}/{prefix}"}))


def kvgraft_push(src: str, home: str, prefix: str) -> dict[str, Any]:
    reg = _registry(Path(home), Path(home) / "cache", prefix)
    reg.catalog  # noqa: B018  (open and migrate the catalog outside the timed region)
    reg.store  # noqa: B018
    warm_imports()
    warm_memory()
    t0, c0 = time.perf_counter(), client_cpu()
    result = reg.push(src, "bench/kv:1")
    return {"seconds": time.perf_counter() - t0, "cpu": client_cpu() - c0,
            "stored": result.stored_size, "blobs_stored": result.blobs_stored}


def kvgraft_pull(home: str, cache: str, out: str, prefix: str) -> dict[str, Any]:
    reg = _registry(Path(home), Path(cache), prefix)
    reg.catalog  # noqa: B018
    reg.store  # noqa: B018
    warm_imports()
    warm_memory()
    t0, c0 = time.perf_counter(), client_cpu()
    result = reg.pull("bench/kv:1", Path(out))
    return {"seconds": time.perf_counter() - t0, "cpu": client_cpu() - c0,
            "fetched": result.stats.fetched}


def _client() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client("s3", config=Config(s3={"addressing_style": "path"}))


def baseline_push(src: str) -> dict[str, Any]:
    client = _client()
    warm_memory()
    t0, c0 = time.perf_counter(), client_cpu()
    client.upload_file(src, BUCKET, BASELINE_KEY)
    return {"seconds": time.perf_counter() - t0, "cpu": client_cpu() - c0}


def baseline_pull(out: str) -> dict[str, Any]:
    client = _client()
    warm_memory()
    t0, c0 = time.perf_counter(), client_cpu()
    client.download_file(BUCKET, BASELINE_KEY, out)
    return {"seconds": time.perf_counter() - t0, "cpu": client_cpu() - c0}


def raw_push(src: str) -> dict[str, Any]:
    """What a user does without kvgraft: upload the KV file as it is, and record its
    SHA-256 to check downloads against."""
    client = _client()
    warm_memory()
    t0, c0 = time.perf_counter(), client_cpu()
    client.upload_file(src, BUCKET, RAW_KEY)
    sha256_file(Path(src))
    return {"seconds": time.perf_counter() - t0, "cpu": client_cpu() - c0}


def raw_pull(out: str) -> dict[str, Any]:
    """Download the raw KV file and check its SHA-256."""
    client = _client()
    warm_memory()
    t0, c0 = time.perf_counter(), client_cpu()
    client.download_file(BUCKET, RAW_KEY, out)
    sha256_file(Path(out))
    return {"seconds": time.perf_counter() - t0, "cpu": client_cpu() - c0}


CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {
    "kvgraft-push": kvgraft_push, "kvgraft-pull": kvgraft_pull,
    "baseline-push": baseline_push, "baseline-pull": baseline_pull,
    "raw-push": raw_push, "raw-pull": raw_pull,
}


def pin_group(pgid: int, cores: set[int]) -> None:
    """Bind every thread of process group `pgid` to `cores` (threads started later inherit
    their creator's binding)."""
    for pid, _ in _group_stats(pgid):
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cores)
            except ProcessLookupError:
                continue  # exited meanwhile


def child(env: dict[str, str], server_pgid: int, *argv: str,
          cores: set[int] | None = None) -> tuple[dict[str, Any], int]:
    """Run one measurement in its own process (bound to `cores` when given); its result
    gains "server_cpu", the CPU seconds the S3 server used meanwhile (it serves nobody
    else)."""
    # Each measurement starts with no dirty pages left by the one before: a pull fsyncs its
    # output and would otherwise also wait for an earlier upload's writeback.
    os.sync()
    before = server_cpu(server_pgid)
    command = [sys.executable, "-m", "benchmarks.s3", "--child", *argv]
    if cores is not None:
        command = ["taskset", "-c", ",".join(map(str, sorted(cores))), *command]
    proc = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {argv} failed with {proc.returncode}")
    result = json.loads(proc.stdout)
    result["server_cpu"] = server_cpu(server_pgid) - before
    return result, result.pop("peak_rss")


def _concatenate_blobs(client: Any, prefix: str, out: Path) -> int:
    """The artifact's stored bytes as one file: what the baseline moves."""
    size = 0
    with open(out, "wb") as f:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                     Prefix=f"{prefix}/"):
            for obj in page.get("Contents", []):
                body = client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"]
                for block in body.iter_chunks(1 << 20):
                    f.write(block)
                size += obj["Size"]
    return size


Result = tuple[dict[str, Any], int]


def rounds_of(rounds: int, ours: Callable[[int], Result], base: Callable[[int], Result],
              ) -> tuple[dict[str, Any], int, dict[str, Any], int]:
    """Median seconds and CPU seconds (client, server) and the highest peak RSS of each side
    over `rounds` alternating rounds."""
    mine: list[Result] = []
    theirs: list[Result] = []
    for r in range(rounds):
        if r % 2:
            theirs.append(base(r))
            mine.append(ours(r))
        else:
            mine.append(ours(r))
            theirs.append(base(r))

    def summary(results: list[Result]) -> tuple[dict[str, Any], int]:
        seconds = [res["seconds"] for res, _ in results]
        return ({"seconds": statistics.median(seconds),
                 "rounds": [round(x, 3) for x in seconds],
                 "cpu": statistics.median(res["cpu"] for res, _ in results),
                 "server_cpu": statistics.median(res["server_cpu"] for res, _ in results)},
                max(rss for _, rss in results))

    return (*summary(mine), *summary(theirs))


def cpu_columns(rows: list[dict[str, Any]], size: int,
                measured: dict[str, tuple[dict[str, Any], int, dict[str, Any], int]],
                ) -> list[dict[str, Any]]:
    """Add CPU seconds per GB of KV file, client and server, of each side to each row."""
    gb = size / 1e9
    for row, (ours, _, base, _) in zip(rows, measured.values(), strict=True):
        row.update({
            "kvgraft_client_cpu_s_per_GB": round(ours["cpu"] / gb, 2),
            "baseline_client_cpu_s_per_GB": round(base["cpu"] / gb, 2),
            "kvgraft_server_cpu_s_per_GB": round(ours["server_cpu"] / gb, 2),
            "baseline_server_cpu_s_per_GB": round(base["server_cpu"] / gb, 2)})
    return rows


def run(workdir: Path, kv_file: Path, report: Callable[[dict[str, Any]], None],
        rounds: int = 3) -> None:
    from tests.support.daemons import start_seaweedfs

    scratch = workdir / "s3"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    server = start_seaweedfs(scratch / "server")
    blobs, pulled = scratch / "blobs.bin", scratch / "pulled.kv"
    try:
        server.create_bucket(BUCKET)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KVGRAFT_", "AWS_"))} | server.env \
            | warm_env(kv_file.stat().st_size)
        home = [scratch / f"home{r}" for r in range(rounds)]
        assert server.process is not None
        pgid = server.process.pid  # weed runs in a process group of its own

        def our_push(r: int) -> Result:
            result = child(env, pgid, "kvgraft-push", str(kv_file), str(home[r]), f"{PREFIX}{r}")
            if result[0]["blobs_stored"] == 0:
                raise RuntimeError("a benchmark push round stored nothing: not measured")
            if r == 0:  # the baseline moves these bytes
                _concatenate_blobs(server.client(), f"{PREFIX}0", blobs)
            return result

        def our_pull(r: int) -> Result:
            cache = scratch / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            pulled.unlink(missing_ok=True)
            return child(env, pgid, "kvgraft-pull", str(home[0]), str(cache), str(pulled),
                          f"{PREFIX}0")

        def base_pull(r: int) -> Result:
            out = scratch / "blobs.out"
            out.unlink(missing_ok=True)
            return child(env, pgid, "baseline-pull", str(out))

        push = rounds_of(rounds, our_push, lambda r: child(env, pgid, "baseline-push", str(blobs)))
        pull = rounds_of(rounds, our_pull, base_pull)
    finally:
        server.stop()
    if sha256_file(kv_file) != sha256_file(pulled):
        raise RuntimeError("the KV file pulled through S3 differs from the pushed one")
    size, stored = kv_file.stat().st_size, blobs.stat().st_size
    measured = {"push": push, "pull": pull}
    for row in cpu_columns(ratio_rows("s3", size, measured,
                          {"stored_MB": round(stored / 1e6, 1),
                           "compression": round(size / stored, 3), "rounds": rounds,
                           "baseline": "boto3 upload_file/download_file of the stored "
                                       "blobs as one file"}), size, measured):
        report(row)
    shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        from benchmarks.core import peak_rss

        result = CHILDREN[sys.argv[2]](*sys.argv[3:])
        print(json.dumps({**result, "peak_rss": peak_rss()}))
        return
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from benchmarks.core import kv_file

    args.workdir.mkdir(parents=True, exist_ok=True)
    run(args.workdir, kv_file(args.workdir, args.size_mib),
        lambda row: print(json.dumps(row), flush=True), args.rounds)


if __name__ == "__main__":
    main()

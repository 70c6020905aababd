"""Push and pull through S3 over a link shaped like a real one, next to what a user would
otherwise do: boto3 `upload_file` / `download_file` (default TransferConfig) of the raw KV
file plus a SHA-256 of it (to record, or to check what arrived).

SeaweedFS and every client run in a network namespace of their own, where the traffic to and
from the S3 port only is shaped to `rate` (htb + u32 on the namespace's loopback): a limit
on all of loopback would also charge SeaweedFS's own hops between its gateway, filer and
volume server, counting each byte two or three times. Needs root and iproute2 (`ip netns`,
`tc`); without them the row says why it was skipped. Rounds alternate which side goes first;
rows give medians (every round's seconds too), and CPU seconds per GB of KV file, client and
server (benchmarks.s3).

Two setups: every process on every core (client and server compete for the same CPUs), and
pinned, as a deployment runs them: SeaweedFS bound to the first core the benchmark may use,
each client to the second, so neither pays for the other's CPU (needs two cores).

    python -m benchmarks.s3link [--size-mib 1024] [--rate 1gbit] [--rounds 3]
                                [--payload-signing auto|on|off] [--pin both|no|yes]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.core import ratio_rows, sha256_file, warm_env
from benchmarks.s3 import BUCKET, PREFIX, Result, child, cpu_columns, rounds_of


def shape(port: int, rate: str) -> None:
    """Limit traffic to and from `port` on this namespace's loopback to `rate`; the rest
    of loopback stays fast."""
    tc = ["tc", "-s"]
    steps = [
        ["qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "20",
         "r2q", "1000"],
        ["class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", rate,
         "ceil", rate, "burst", "1mb", "cburst", "1mb"],
        ["class", "add", "dev", "lo", "parent", "1:", "classid", "1:20", "htb", "rate",
         "100gbit", "ceil", "100gbit"],
        *(["filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "u32", "match",
           "ip", direction, str(port), "0xffff", "flowid", "1:10"]
          for direction in ("dport", "sport")),
    ]
    # an earlier setup's shaping in this namespace goes first (none: tc says so, ignored)
    subprocess.run([*tc, "qdisc", "del", "dev", "lo", "root"], check=False, capture_output=True)
    for step in steps:
        subprocess.run([*tc, *step], check=True, capture_output=True)


def inside(workdir: Path, kv_file: Path, rate: str, rounds: int, signing: str,
           report: Callable[[dict[str, Any]], None], pinned: bool = False) -> None:
    """The measurement, run inside the namespace."""
    from benchmarks.s3 import pin_group
    from tests.support.daemons import start_seaweedfs

    bench = f"s3 {rate} link" + (", pinned" if pinned else "")
    cores = sorted(os.sched_getaffinity(0))
    if pinned and len(cores) < 2:
        report({"bench": bench, "skipped": "pinning the server and the client to a core "
                                           "each needs two cores"})
        return
    server_cores, client_cores = ({cores[0]}, {cores[1]}) if pinned else (None, None)

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    scratch = workdir / "s3link"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    server = start_seaweedfs(scratch / "server")
    pulled, raw_out = scratch / "pulled.kv", scratch / "raw.out"
    stored = 0
    try:
        assert server.process is not None
        pgid = server.process.pid
        if server_cores is not None:
            pin_group(pgid, server_cores)
        shape(int(server.endpoint.rsplit(":", 1)[1]), rate)
        server.create_bucket(BUCKET)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KVGRAFT_", "AWS_"))} | server.env \
            | warm_env(kv_file.stat().st_size)
        home = [scratch / f"home{r}" for r in range(rounds)]

        def our_push(r: int) -> Result:
            nonlocal stored
            result = child(env | {"KVGRAFT_S3_PAYLOAD_SIGNING": signing}, pgid,
                           "kvgraft-push", str(kv_file), str(home[r]), f"{PREFIX}{r}",
                           cores=client_cores)
            if result[0]["blobs_stored"] == 0:
                raise RuntimeError("a benchmark push round stored nothing: not measured")
            stored = result[0]["stored"]
            return result

        def our_pull(r: int) -> Result:
            cache = scratch / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            pulled.unlink(missing_ok=True)
            return child(env, pgid, "kvgraft-pull", str(home[0]), str(cache), str(pulled),
                         f"{PREFIX}0", cores=client_cores)

        def raw_pull(r: int) -> Result:
            raw_out.unlink(missing_ok=True)
            return child(env, pgid, "raw-pull", str(raw_out), cores=client_cores)

        push = rounds_of(rounds, our_push, lambda r: child(env, pgid, "raw-push", str(kv_file),
                                                           cores=client_cores))
        pull = rounds_of(rounds, our_pull, raw_pull)
    finally:
        server.stop()
    if sha256_file(kv_file) != sha256_file(pulled):
        raise RuntimeError("the KV file pulled through S3 differs from the pushed one")
    size = kv_file.stat().st_size
    measured = {"push": push, "pull": pull}
    placement = (f"server on core {cores[0]}, client on core {cores[1]}" if pinned
                 else f"server and client on cores {','.join(map(str, cores))}")
    for row in cpu_columns(ratio_rows(bench, size, measured, {
            "link": f"{rate} on the S3 port only", "cpus": placement,
            "stored_MB": round(stored / 1e6, 1),
            "compression": round(size / stored, 3), "rounds": rounds,
            "kvgraft_payload_signing": signing,
            "baseline": "boto3 upload_file/download_file of the raw KV file + SHA-256"}),
            size, measured):
        report(row)
    shutil.rmtree(scratch, ignore_errors=True)


def run(workdir: Path, kv_file: Path, report: Callable[[dict[str, Any]], None],
        rate: str = "1gbit", rounds: int = 3, signing: str = "auto", pin: str = "both",
        ) -> None:
    name = f"kvgraft-bench-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                          check=False) if shutil.which("ip") else None
    if made is None or made.returncode != 0:
        why = "no `ip` command" if made is None else made.stderr.strip()
        report({"bench": f"s3 {rate} link", "skipped": f"cannot make a network namespace "
                                                     f"(needs root and iproute2): {why}"})
        return
    try:
        for pinned in {"no": [False], "yes": [True], "both": [False, True]}[pin]:
            proc = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-m",
                                   "benchmarks.s3link", "--inside", str(workdir), str(kv_file),
                                   rate, str(rounds), signing, str(int(pinned))],
                                  stdout=subprocess.PIPE, text=True, check=False)
            for line in proc.stdout.splitlines():
                report(json.loads(line))
            if proc.returncode != 0:
                raise RuntimeError(f"the shaped-link benchmark failed with {proc.returncode}")
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def main() -> None:
    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)

    if len(sys.argv) == 8 and sys.argv[1] == "--inside":
        inside(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]),
               sys.argv[6], emit, pinned=sys.argv[7] == "1")
        return
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--payload-signing", choices=("auto", "on", "off"), default="auto",
                        help="KVGRAFT_S3_PAYLOAD_SIGNING for kvgraft's pushes (off: "
                             "SeaweedFS checks the CRC32 instead)")
    parser.add_argument("--pin", choices=("both", "no", "yes"), default="both",
                        help="run with every process on every core, pinned (server and "
                             "client on a core each), or both")
    args = parser.parse_args()
    from benchmarks.core import kv_file

    args.workdir.mkdir(parents=True, exist_ok=True)
    run(args.workdir.absolute(), kv_file(args.workdir, args.size_mib).absolute(), emit,
        args.rate, args.rounds, args.payload_signing, args.pin)


if __name__ == "__main__":
    main()

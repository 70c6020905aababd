"""`make bench`: every benchmark, each against a baseline measured in the same run.

Rows are printed as they come and written to .bench/results.json; .bench/report.html
shows them in plots (benchmarks.report).
    python -m benchmarks.run [--size-mib 1024] [--quick]
        [--only startup,core,s3,s3link,codec,graft,server,load,vllm,vllm-passes,restore,
                llamacpp,cross-engine,catalog]
--quick: the catalog at 10k and 100k chunk rows only (not 1M).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

WORKDIR = Path(".bench")


def cpu_model() -> str:
    """The processor's name: figures from two machine kinds differ by more than their
    core counts say (per-byte costs moved 1.8x between two 2-core kinds)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=1024, help="KV file size for push/pull")
    parser.add_argument("--only",
                        default="startup,core,s3,s3link,codec,graft,server,load,vllm,"
                                "vllm-passes,restore,llamacpp,cross-engine,catalog")
    parser.add_argument("--quick", action="store_true",
                        help="the catalog at 10k and 100k chunk rows only")
    args = parser.parse_args()
    wanted = set(args.only.split(","))
    rows: list[dict[str, Any]] = []
    started = time.monotonic()

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    WORKDIR.mkdir(exist_ok=True)
    if "startup" in wanted:
        from benchmarks import startup

        startup.run(report)
    from benchmarks import core

    kv = core.kv_file(WORKDIR, args.size_mib) if wanted & {"core", "s3", "server"} else Path()
    if "core" in wanted:
        core.run(WORKDIR, args.size_mib, report)
    if "s3" in wanted:
        from benchmarks import s3

        s3.run(WORKDIR, kv, report)
    if "s3link" in wanted:
        from benchmarks import s3link

        s3link.run(WORKDIR.absolute(), kv.absolute(), report)
    if "codec" in wanted:
        from benchmarks import codec

        codec.run(report)
    if "graft" in wanted:
        from benchmarks import graft

        graft.run(report)
    if "server" in wanted:
        from benchmarks import server

        server.run(WORKDIR, kv, report)
    if "load" in wanted:
        from benchmarks import server_load

        server_load.run(WORKDIR, report)
    if "vllm" in wanted:
        from benchmarks import vllm

        vllm.run(report)
    if "vllm-passes" in wanted:
        from benchmarks import vllm_passes

        vllm_passes.run(report, WORKDIR)
    if "restore" in wanted:
        from benchmarks import restore_scaling

        restore_scaling.run(report)
    if "llamacpp" in wanted:
        from benchmarks import llamacpp

        llamacpp.run(report, WORKDIR)
    if "cross-engine" in wanted:
        from benchmarks import cross_engine

        cross_engine.run(report, WORKDIR)
    if "catalog" in wanted:
        from benchmarks import catalog_scale

        catalog_scale.run(report, WORKDIR, sizes=catalog_scale.QUICK if args.quick
                          else catalog_scale.SIZES)
    result = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "seconds": round(time.monotonic() - started),
              "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(),
                          "python": platform.python_version()},
              "rows": rows}
    (WORKDIR / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {WORKDIR / 'results.json'}")
    from benchmarks import report as html_report

    print(f"wrote {html_report.build(WORKDIR / 'results.json')}")


if __name__ == "__main__":
    main()

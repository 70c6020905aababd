"""Start-up time of the command line, next to `python -c pass` measured in the same run.

Each command runs `--runs` times, the commands interleaved round-robin so that a burst of
load on the machine hits them all alike; a row gives the median wall time and the median
CPU time (user + system) of the process, and the same for the baseline.

    {"bench": "startup", "command": "kvgraft --version", "wall_s": ..., "cpu_s": ...,
     "baseline_wall_s": ..., "baseline_cpu_s": ..., "target_s": 0.15}

`ls` runs twice: on a home that was never written to (no catalog yet: nothing to load but
the command line) and on an empty catalog (`kvgraft db upgrade` made it; SQLAlchemy Core
loads, not the ORM or Alembic).

    python -m benchmarks.startup [--runs 11]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGETS = {"kvgraft --version": 0.15, "kvgraft ls (empty catalog)": 0.4,
           "kvgraft ls (new home)": 0.4}


def _kvgraft() -> list[str]:
    """The installed console script beside this interpreter (what a user runs)."""
    script = Path(sys.executable).with_name("kvgraft")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvgraft.cli"]


def _time(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `argv`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {err.strip()}")
    return wall, usage.ru_utime + usage.ru_stime


def measure(runs: int) -> list[dict[str, Any]]:
    kv = _kvgraft()
    with tempfile.TemporaryDirectory(prefix="kvgraft-startup-") as tmp:
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
        fresh = {**base, "KVGRAFT_HOME": f"{tmp}/new", "KVGRAFT_CACHE": f"{tmp}/cache"}
        empty = {**base, "KVGRAFT_HOME": f"{tmp}/empty", "KVGRAFT_CACHE": f"{tmp}/cache"}
        subprocess.run([*kv, "db", "upgrade"], env=empty, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cases: dict[str, tuple[list[str], dict[str, str]]] = {
            "python -c pass": ([sys.executable, "-c", "pass"], base),
            "kvgraft --version": ([*kv, "--version"], fresh),
            "kvgraft --help": ([*kv, "--help"], fresh),
            "kvgraft ls (new home)": ([*kv, "ls"], fresh),
            "kvgraft ls (empty catalog)": ([*kv, "ls"], empty),
        }
        for argv, env in cases.values():  # warm the page cache and .pyc files once
            _time(argv, env)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        for _ in range(runs):
            for name, (argv, env) in cases.items():
                samples[name].append(_time(argv, env))
        if Path(f"{tmp}/new/catalog.db").exists():
            raise RuntimeError("`kvgraft ls` created a catalog in a home never written to")

    def med(name: str, i: int) -> float:
        return round(statistics.median(s[i] for s in samples[name]), 4)

    rows = []
    for name in cases:
        if name == "python -c pass":
            continue
        row: dict[str, Any] = {"bench": "startup", "command": name, "runs": runs,
                               "wall_s": med(name, 0), "cpu_s": med(name, 1),
                               "baseline": "python -c pass",
                               "baseline_wall_s": med("python -c pass", 0),
                               "baseline_cpu_s": med("python -c pass", 1)}
        if name in TARGETS:
            row["target_s"] = TARGETS[name]
        rows.append(row)
    return rows


def run(report: Callable[[dict[str, Any]], None], *, runs: int = 11) -> None:
    for row in measure(runs):
        report(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()
    run(lambda row: print(json.dumps(row), flush=True), runs=args.runs)


if __name__ == "__main__":
    main()

"""`kvgraft serve` under hostile load: 16 normal clients' latency while 200 slow clients
hold connections, beside the same 16 clients alone, in the same run.

Normal clients: 16 threads, each a keep-alive session resolving a tag and fetching the
graft's OCI manifest in a loop for `seconds`. Slow clients (another process, asyncio, so
they cost this process no GIL): half trickle a request header a byte a second and never
end it (the server's header timeout drops them; they reconnect at once); half fetch a blob
and read its answer 1 KiB a second (flow control holds them; the header limit does not).
Row: {"bench": "server load", "normal_clients", "slow_clients", "seconds", "requests",
"errors", "p50_ms", "p99_ms" (with the slow clients), "alone_p50_ms", "alone_p99_ms",
"p99_ratio" (with / alone), "workers", "slow_dropped" (header-trickling connections the
server closed)}.

    python -m benchmarks.server_load [--seconds 15] [--slow 200] [--workdir .bench]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = "bench/load"
NORMAL = 16


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _normal(url: str, secret: str, seconds: float) -> tuple[list[float], int]:
    import requests

    def one(_: int) -> tuple[list[float], int]:
        s = requests.Session()
        s.headers["Authorization"] = f"Bearer {secret}"
        took, errors, end = [], 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            for path in (f"/kvgraft/v1/resolve?ref={REPO}:v1", f"/v2/{REPO}/manifests/v1"):
                t = time.perf_counter()
                try:
                    ok = s.get(url + path, timeout=30).status_code == 200
                except requests.RequestException:
                    ok = False
                took.append(time.perf_counter() - t)
                errors += not ok
        return took, errors

    with ThreadPoolExecutor(NORMAL) as pool:
        results = list(pool.map(one, range(NORMAL)))
    return [t for r in results for t in r[0]], sum(r[1] for r in results)


async def _slow(port: int, blob_path: str, secret: str, n: int, seconds: float) -> int:
    """Run `n` slow clients for `seconds`; returns how many trickling connections the
    server dropped."""
    dropped = 0
    end = time.monotonic() + seconds

    async def trickle() -> None:
        nonlocal dropped
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /v2/ HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                while time.monotonic() < end:
                    writer.write(b"a")
                    await writer.drain()
                    await asyncio.sleep(1.0)
                    if reader.at_eof():
                        break
                writer.close()
            except (ConnectionError, OSError):
                pass
            dropped += 1
            await asyncio.sleep(0.1)

    async def read_slowly() -> None:
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(f"GET {blob_path} HTTP/1.1\r\nHost: x\r\n"
                             f"Authorization: Bearer {secret}\r\n\r\n".encode())
                await writer.drain()
                while time.monotonic() < end and await reader.read(1024):
                    await asyncio.sleep(1.0)
                writer.close()
            except (ConnectionError, OSError):
                await asyncio.sleep(0.1)

    await asyncio.gather(*(trickle() if i % 2 == 0 else read_slowly() for i in range(n)))
    return dropped


def run(workdir: Path, report: Callable[[dict[str, Any]], None], *, seconds: float = 15.0,
        slow: int = 200, workers: int = 2) -> None:
    import requests

    from benchmarks.server import _kvgraft, _serve
    from tests.support.synthetic import write_synthetic

    home = workdir / "load-home"
    shutil.rmtree(home, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    env.update(KVGRAFT_HOME=str(home.absolute()), KVGRAFT_CACHE=str((home / "cache").absolute()))
    kv = write_synthetic(workdir / "load.kv", num_layers=30, kv_heads=3, head_dim=64,
                         tokens=512, seed=5, name="bench")
    _kvgraft(env, "push", str(kv), f"{REPO}:v1")
    secret = _kvgraft(env, "token", "create", "--scope", "repository:bench/*:pull")
    proc, url = _serve(env, workdir, "load", "--workers", str(workers))
    try:
        auth = {"Authorization": f"Bearer {secret}"}
        layers = requests.get(f"{url}/v2/{REPO}/manifests/v1", headers=auth,
                              timeout=30).json()["layers"]
        biggest = max(layers, key=lambda d: d["size"])["digest"]
        _normal(url, secret, 2.0)  # warm up
        alone, _ = _normal(url, secret, seconds)
        port = int(url.rsplit(":", 1)[1])
        slow_proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.server_load", "--slow-only", "--port", str(port),
             "--blob", f"/v2/{REPO}/blobs/{biggest}", "--token", secret,
             "--slow", str(slow), "--seconds", str(seconds + 8)],
            stdout=subprocess.PIPE, text=True)
        time.sleep(5.0)  # every slow client connected and holding on
        loaded, errors = _normal(url, secret, seconds)
        out, _ = slow_proc.communicate(timeout=seconds + 60)
        report({"bench": "server load", "normal_clients": NORMAL, "slow_clients": slow,
                "seconds": seconds, "requests": len(loaded), "errors": errors,
                "p50_ms": round(1000 * statistics.median(loaded), 1),
                "p99_ms": round(1000 * _percentile(loaded, 99), 1),
                "alone_p50_ms": round(1000 * statistics.median(alone), 1),
                "alone_p99_ms": round(1000 * _percentile(alone, 99), 1),
                "p99_ratio": round(_percentile(loaded, 99) / _percentile(alone, 99), 2),
                "workers": workers, "slow_dropped": int(json.loads(out)["dropped"])})
        if proc.poll() is not None:
            raise RuntimeError("kvgraft serve died under the slow clients")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--slow", type=int, default=200)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    parser.add_argument("--slow-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--blob", help=argparse.SUPPRESS)
    parser.add_argument("--token", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.slow_only:
        dropped = asyncio.run(_slow(args.port, args.blob, args.token, args.slow, args.seconds))
        print(json.dumps({"dropped": dropped}))
        return
    args.workdir.mkdir(exist_ok=True)
    run(args.workdir, lambda row: print(json.dumps(row), flush=True), seconds=args.seconds,
        slow=args.slow)


if __name__ == "__main__":
    main()

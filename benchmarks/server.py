"""Pull through `kvgraft serve` next to direct store access, in the same run, and requests
per second for `resolve` and `tags/list`.

Pull: every blob of one graft (its OCI manifest's layers) fetched over HTTP by one client,
each hashed as it streams in, against the same blobs read from the same store, decoded and
hashed in this process (what the server does before it sends a byte): the ratio is what
HTTP and the server cost. Requests per second: 8 client threads for a few seconds each.

On S3 (SeaweedFS `weed mini` on loopback), one graft pulled three ways in the same run, each
by kvgraft's own client code on 2 threads (as `kvgraft pull` does), every blob decoded and
hashed: straight from the bucket (S3BlobStore), through a server that sends the bytes
(`kvgraft serve`), and through a server that redirects to presigned URLs
(`--redirect-blobs`). Medians of three rounds, the order rotating each round.

    python -m benchmarks.server [--size-mib 256] [--workdir .bench] [--no-s3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = "bench/server"
THREADS = 8
RPS_SECONDS = 3.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _kvgraft(env: dict[str, str], *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


def _direct(env: dict[str, str], layers: list[dict[str, Any]]) -> float:
    from kvgraft.client import Registry
    from kvgraft.codecs.codec import decode_blob
    from kvgraft.config import Config
    from kvgraft.digest import Digest

    reg = Registry(Config.from_env(env))
    store = reg.store
    t0 = time.perf_counter()
    for desc in layers[1:]:  # the kvgraft manifest lives in the catalog, not the store
        d = Digest.parse(desc["digest"])
        _, data = decode_blob(store.get(d), desc["size"])
        d.check(Digest.of(data), "bench")
    seconds = time.perf_counter() - t0
    reg.close()
    return seconds


def _through_server(session: Any, url: str, layers: list[dict[str, Any]]) -> float:
    t0 = time.perf_counter()
    for desc in layers[1:]:
        h = hashlib.sha256()
        with session.get(f"{url}/v2/{REPO}/blobs/{desc['digest']}", stream=True) as r:
            r.raise_for_status()
            for piece in r.iter_content(1 << 20):
                h.update(piece)
        if "sha256:" + h.hexdigest() != desc["digest"]:
            raise RuntimeError(f"blob {desc['digest']} does not check")
    return time.perf_counter() - t0


def _rps(make: Callable[[], Any], path: str) -> float:
    def worker(_: int) -> int:
        s = make()
        n, end = 0, time.perf_counter() + RPS_SECONDS
        while time.perf_counter() < end:
            s.get(path).raise_for_status()
            n += 1
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        total = sum(pool.map(worker, range(THREADS)))
    return total / (time.perf_counter() - t0)


def run(workdir: Path, kv: Path, report: Callable[[dict[str, Any]], None],
        workers: int = 2, s3: bool = True) -> None:
    import requests

    home = workdir / "server-home"
    shutil.rmtree(home, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    env.update(KVGRAFT_HOME=str(home.absolute()), KVGRAFT_CACHE=str((home / "cache").absolute()))
    _kvgraft(env, "push", str(kv), f"{REPO}:v1")
    secret = _kvgraft(env, "token", "create", "--scope", "repository:bench/*:pull")
    port = _port()
    url = f"http://127.0.0.1:{port}"
    log = open(workdir / "server.log", "wb")  # noqa: SIM115  (lives as long as the server)
    proc = subprocess.Popen([sys.executable, "-m", "kvgraft.cli", "serve", "--port", str(port),
                             "--workers", str(workers)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            try:
                requests.get(f"{url}/v2/", timeout=2)
                break
            except requests.ConnectionError:
                time.sleep(0.2)

        def session() -> Any:
            s = requests.Session()
            s.headers["Authorization"] = f"Bearer {secret}"
            return s

        s = session()
        layers = s.get(f"{url}/v2/{REPO}/manifests/v1").json()["layers"]
        size = sum(d["size"] for d in layers[1:])
        # alternate, take the median of three rounds each
        direct, served = [], []
        for _ in range(3):
            direct.append(_direct(env, layers))
            served.append(_through_server(s, url, layers))
        d, v = sorted(direct)[1], sorted(served)[1]
        report({"bench": "server pull (proxied)", "size_mib": round(size / 2**20),
                "kvgraft_MBps": round(size / 1e6 / v, 1),
                "baseline_MBps": round(size / 1e6 / d, 1), "ratio": round(d / v, 2),
                "baseline": "same store, decode + hash in process", "workers": workers,
                "kvgraft_rounds_s": [round(x, 3) for x in served],
                "baseline_rounds_s": [round(x, 3) for x in direct]})
        for name, path in (("resolve", f"{url}/kvgraft/v1/resolve?ref={REPO}:v1"),
                           ("tags/list", f"{url}/v2/{REPO}/tags/list")):
            report({"bench": f"server {name}", "requests_per_s": round(_rps(session, path)),
                    "client_threads": THREADS, "workers": workers})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    if s3:
        run_s3(workdir, kv, report)


S3_BUCKET = "bench-server"
PULL_THREADS = 2


def _pull_blobs(store: Any, refs: list[Any]) -> float:
    """Seconds to fetch every blob of `refs` from `store` and check each (decoded, hashed)."""
    from kvgraft.codecs.codec import max_stored_size
    from kvgraft.transfer.pull import verify_stored

    def one(ref: Any) -> None:
        verify_stored(ref, store.get(ref.digest, max_stored_size(ref.size)), store.url)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(PULL_THREADS) as pool:
        list(pool.map(one, refs))
    return time.perf_counter() - t0


def _serve(env: dict[str, str], workdir: Path, name: str, *extra: str) -> tuple[Any, str]:
    import requests

    port = _port()
    with open(workdir / f"server-{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvgraft.cli", "serve", "--port",
                                 str(port), *extra], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"kvgraft serve exited: see {workdir / f'server-{name}.log'}")
        try:
            requests.get(f"{url}/v2/", timeout=2)
            return proc, url
        except requests.ConnectionError:
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"kvgraft serve did not answer on {url}")


def run_s3(workdir: Path, kv: Path, report: Callable[[dict[str, Any]], None],
           rounds: int = 3) -> None:
    """Rows `server pull s3 (proxied)` and `server pull s3 (redirect)`, each against the
    direct S3 pull of the same graft in the same rounds."""
    from kvgraft.blobstore.s3 import S3BlobStore
    from kvgraft.formats.manifest import Manifest
    from kvgraft.reference import Reference
    from kvgraft.remote.http import HttpRemote
    from tests.support.daemons import start_seaweedfs

    scratch = workdir / "server-s3"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    s3 = start_seaweedfs(scratch / "weed")
    procs: list[Any] = []
    try:
        s3.create_bucket(S3_BUCKET)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KVGRAFT_", "AWS_"))} | s3.env
        env.update(KVGRAFT_HOME=str((scratch / "home").absolute()),
                   KVGRAFT_CACHE=str((scratch / "cache").absolute()),
                   KVGRAFT_BLOB_URL=f"s3://{S3_BUCKET}/kv")
        _kvgraft(env, "push", str(kv), f"{REPO}:v1")
        secret = _kvgraft(env, "token", "create", "--scope", "repository:bench/*:pull")
        proxied, proxied_url = _serve(env, scratch, "proxied")
        procs.append(proxied)
        redirect, redirect_url = _serve(env, scratch, "redirect", "--redirect-blobs")
        procs.append(redirect)
        # The direct store finds the endpoint and credentials the standard way.
        saved = {k: os.environ.get(k) for k in s3.env}
        os.environ.update(s3.env)
        try:
            direct = S3BlobStore(S3_BUCKET, "kv")
        finally:
            for name, old in saved.items():
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old
        ref = Reference.parse(f"{REPO}:v1")
        first = HttpRemote(proxied_url, secret)
        manifest: Manifest = first.manifest(REPO, first.resolve(ref))
        refs = manifest.blobs()
        ways = {"direct": direct, "proxied": first.store(REPO),
                "redirect": HttpRemote(redirect_url, secret).store(REPO)}
        seconds: dict[str, list[float]] = {w: [] for w in ways}
        order = list(ways)
        for r in range(rounds):
            for way in order[r % 3:] + order[:r % 3]:
                seconds[way].append(_pull_blobs(ways[way], refs))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        s3.stop()
    redirected = len(re.findall(r'GET /kvgraft/v1/stored/\S+ HTTP/1.1" 307\b',
                                (scratch / "server-redirect.log").read_text()))
    if redirected < len(refs) * rounds:
        raise RuntimeError(f"the redirecting server redirected {redirected} blob reads, "
                           f"not {len(refs) * rounds}: not measured")
    size = sum(r.size for r in refs)
    d = sorted(seconds["direct"])[rounds // 2]
    for way in ("proxied", "redirect"):
        v = sorted(seconds[way])[rounds // 2]
        report({"bench": f"server pull s3 ({way})", "size_mib": round(size / 2**20),
                "kvgraft_MBps": round(size / 1e6 / v, 1),
                "baseline_MBps": round(size / 1e6 / d, 1), "ratio": round(d / v, 2),
                "baseline": "same graft straight from the bucket (S3BlobStore), same rounds",
                "client_threads": PULL_THREADS, "rounds": rounds,
                "kvgraft_rounds_s": [round(x, 3) for x in seconds[way]],
                "baseline_rounds_s": [round(x, 3) for x in seconds["direct"]]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 rows")
    args = parser.parse_args()
    args.workdir.mkdir(exist_ok=True)
    from benchmarks.core import kv_file

    kv = kv_file(args.workdir, args.size_mib)
    run(args.workdir, kv, lambda row: print(json.dumps(row), flush=True), args.workers,
        s3=not args.no_s3)


if __name__ == "__main__":
    main()

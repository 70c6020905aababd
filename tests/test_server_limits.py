"""What a client can make `kvgraft serve` hold, against a real server: an upload's decoded
size, request heads, slow and idle connections, open uploads per token, and the few inputs
that used to be taken at face value. Every hostile case runs against small limits, so each
costs the test little; memory is the server process's peak RSS (/proc/PID/status)."""

from __future__ import annotations

import hashlib
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import zstandard
from sqlalchemy import create_engine, text

from kvgraft.codecs.codec import frame_header
from kvgraft.oci.graft import CHUNK_TYPE
from tests.support.serve import Server, kvgraft, make_token, running_server, server_env
from tests.support.synthetic import write_synthetic

MAX_UPLOAD = 40_000_000
MIB = 1 << 20
PER_TOKEN = 4  # what one kvgraft push keeps open at once
LIMITS = ("--max-upload", str(MAX_UPLOAD), "--max-open-uploads", "10",
          "--max-open-uploads-per-token", str(PER_TOKEN), "--header-timeout", "2",
          "--body-timeout", "2", "--min-body-rate", "1024")


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


class Peak:
    """The server's peak RSS above where it stood when the block began."""

    def __init__(self, server: Server) -> None:
        self.pid = server.process.pid
        self.growth = 0

    def __enter__(self) -> Peak:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # resets VmHWM to VmRSS
        self.before = _status(self.pid)["VmRSS"]
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth = _status(self.pid)["VmHWM"] - self.before


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[tuple[Server, dict[str, str], dict[str, str]]]:
    root = tmp_path_factory.mktemp(f"limits-{request.param}")
    extra: dict[str, str] = {}
    schema = None
    if request.param == "postgres":
        base: str = request.getfixturevalue("postgres_server")
        schema = f"t_{uuid.uuid4().hex[:12]}"
        with create_engine(base).begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        sep = "&" if "?" in base else "?"
        extra["KVGRAFT_CATALOG_URL"] = f"{base}{sep}options=-csearch_path%3D{schema}"
    env = server_env(root / "server", **extra)
    if schema:
        kvgraft(env, "db", "upgrade")
    tokens = {"a": make_token(env, "a", "repository:team/*:pull,push,delete"),
              "b": make_token(env, "b", "repository:other/*:pull,push")}
    node = server_env(root / "node")
    try:
        with running_server(env, root / "server.log", *LIMITS) as server:
            (root / "a.token").write_text(tokens["a"] + "\n")
            kvgraft(node, "remote", "add", "hub", server.url, "--token-file",
                    str(root / "a.token"))
            yield server, tokens, node
            assert server.alive()
        assert "Traceback" not in (root / "server.log").read_text()
    finally:
        if schema:
            with create_engine(request.getfixturevalue("postgres_server")).begin() as conn:
                conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))


def _zeros_frame(size: int, declared: int | None = None) -> bytes:
    """A kvgraft zstd blob of `size` zero bytes (its frame header claiming `declared`),
    built a piece at a time: the test never holds the decoded bytes."""
    obj = zstandard.ZstdCompressor(level=1).compressobj(size=size)
    body = [obj.compress(bytes(min(MIB, size - at))) for at in range(0, size, MIB)]
    body.append(obj.flush())
    return frame_header("zstd", size if declared is None else declared) + b"".join(body)


def _zeros_digest(size: int) -> str:
    h = hashlib.sha256()
    for at in range(0, size, MIB):
        h.update(bytes(min(MIB, size - at)))
    return "sha256:" + h.hexdigest()


def _upload(server: Server, secret: str, repo: str, digest: str, size: int,
            body: bytes) -> requests.Response:
    return requests.put(f"{server.url}/kvgraft/v1/upload/{digest}",
                        params={"repository": repo, "size": str(size)}, data=body,
                        headers=_auth(secret), timeout=60)


# --- an upload's decoded size ------------------------------------------------------------


def test_declared_size_is_bounded_before_the_body_and_decoding_streams(
        served: tuple[Server, dict[str, str], dict[str, str]]) -> None:
    server, tokens, _ = served
    bomb = _zeros_frame(512 * MIB)  # ~16 KB that decodes to 512 MiB
    assert len(bomb) < 64 << 10
    digest = _zeros_digest(512 * MIB)
    _upload(server, tokens["a"], "team/warm", _zeros_digest(MIB), MIB, _zeros_frame(MIB))
    with Peak(server) as peak:
        r = _upload(server, tokens["a"], "team/bomb", digest, 512 * MIB, bomb)
    assert r.status_code == 413 and r.json()["errors"][0]["code"] == "SIZE_INVALID"
    assert peak.growth < 16 * MIB, peak.growth
    # A size within the limit, and a frame that claims more than it: refused from the header.
    with Peak(server) as peak:
        r = _upload(server, tokens["a"], "team/bomb", digest, MAX_UPLOAD - 1, bomb)
    assert r.status_code == 400 and r.json()["errors"][0]["code"] == "DIGEST_INVALID"
    assert peak.growth < 16 * MIB, peak.growth
    # An honest 36 MiB blob is verified and stored without being held whole...
    size = 36 * MIB
    digest = _zeros_digest(size)
    with Peak(server) as peak:
        r = _upload(server, tokens["a"], "team/big", digest, size, _zeros_frame(size))
    assert r.status_code == 200, r.text
    assert peak.growth < 16 * MIB, peak.growth
    # ...and a range read decodes only as far as the range goes.
    url = f"{server.url}/v2/team/big/blobs/{digest}"
    with Peak(server) as peak:
        r = requests.get(url, headers={**_auth(tokens["a"]), "Range": "bytes=5-5"})
    assert r.status_code == 206 and r.content == b"\0"
    assert peak.growth < 16 * MIB, peak.growth
    with Peak(server) as peak, requests.get(url, headers=_auth(tokens["a"]),
                                            stream=True) as r:
        h = hashlib.sha256()
        for piece in r.iter_content(MIB):
            h.update(piece)
    assert r.status_code == 200 and "sha256:" + h.hexdigest() == digest
    assert peak.growth < 16 * MIB, peak.growth


# --- open uploads are shared per token ---------------------------------------------------


def test_one_token_cannot_hold_every_open_upload(
        served: tuple[Server, dict[str, str], dict[str, str]]) -> None:
    server, tokens, _ = served
    opened = []
    for _ in range(PER_TOKEN):
        r = requests.post(f"{server.url}/v2/team/hog/blobs/uploads/", headers=_auth(tokens["a"]))
        assert r.status_code == 202
        opened.append(server.url + r.headers["Location"])
    r = requests.post(f"{server.url}/v2/team/hog/blobs/uploads/", headers=_auth(tokens["a"]))
    assert r.status_code == 429 and "this token" in r.json()["errors"][0]["message"]
    # the other tenant still pushes, chunked and monolithic
    r = requests.post(f"{server.url}/v2/other/kv/blobs/uploads/", headers=_auth(tokens["b"]))
    assert r.status_code == 202
    assert requests.delete(server.url + r.headers["Location"],
                           headers=_auth(tokens["b"])).status_code == 204
    data = b"other's layer"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    r = requests.post(f"{server.url}/v2/other/kv/blobs/uploads/?digest={digest}", data=data,
                      headers=_auth(tokens["b"]))
    assert r.status_code == 201
    for loc in opened:
        assert requests.delete(loc, headers=_auth(tokens["a"])).status_code == 204


# --- input taken at face value -----------------------------------------------------------


def test_tag_without_a_tag_and_deleting_a_graft_chunk_are_refused(
        served: tuple[Server, dict[str, str], dict[str, str]], tmp_path: Path) -> None:
    server, tokens, node = served
    src = write_synthetic(tmp_path / "graft.kv", tokens=300)
    digest = kvgraft(node, "--remote", "hub", "push", str(src), "team/kv:v1",
                     "--chunk-tokens", "128")
    h = _auth(tokens["a"])
    bodies: list[dict[str, str | int | None]] = [
        {"repository": "team/kv", "digest": digest},
        {"repository": "team/kv", "digest": digest, "tag": None},
        {"repository": "team/kv", "digest": digest, "tag": 7}]
    for body in bodies:
        r = requests.post(f"{server.url}/kvgraft/v1/tag", json=body, headers=h)
        assert r.status_code == 400 and r.json()["errors"][0]["code"] == "NAME_INVALID", r.text
    r = requests.post(f"{server.url}/kvgraft/v1/untag", json={"repository": "team/kv"},
                      headers=h)
    assert r.status_code == 400
    assert "None" not in requests.get(f"{server.url}/v2/team/kv/tags/list",
                                      headers=h).json()["tags"]
    manifest = requests.get(f"{server.url}/v2/team/kv/manifests/v1", headers={
        **h, "Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    chunks = [d["digest"] for d in manifest["layers"] if d["mediaType"] == CHUNK_TYPE]
    assert chunks
    r = requests.delete(f"{server.url}/v2/team/kv/blobs/{chunks[0]}", headers=h)
    assert r.status_code == 405 and r.json()["errors"][0]["code"] == "UNSUPPORTED"
    r = requests.get(f"{server.url}/v2/team/kv/blobs/{chunks[0]}", headers=h)
    assert r.status_code == 200 and "sha256:" + hashlib.sha256(r.content).hexdigest() == chunks[0]


# --- connections: heads, slow bodies, idle connections -----------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    """A server allowed 128 open files, as in a small container."""
    root = tmp_path_factory.mktemp("guarded")
    env = server_env(root / "server")
    secret = make_token(env, "pusher", "repository:team/*:pull,push")
    with running_server(env, root / "server.log", *LIMITS, nofile=128) as server:
        yield server, secret
        assert server.alive()
    log = (root / "server.log").read_text()
    assert "Traceback" not in log and "Too many open files" not in log, log[-3000:]


def _connect(server: Server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return s


def _answer(s: socket.socket) -> bytes:
    got = b""
    try:
        while piece := s.recv(65536):
            got += piece
    except (ConnectionResetError, TimeoutError):
        pass
    return got


def test_an_endless_header_is_cut_off_early(guarded: tuple[Server, str]) -> None:
    server, _ = guarded
    s = _connect(server)
    sent = 0
    with Peak(server) as peak:
        s.sendall(b"GET /v2/ HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        try:
            while sent < 100 * MIB:
                s.sendall(b"a" * MIB)
                sent += MIB
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = _answer(s)
    s.close()
    # What the kernel's socket buffers took in before the server's close showed.
    assert sent < 16 * MIB, sent
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:100]
    assert peak.growth < 8 * MIB, peak.growth
    assert requests.get(f"{server.url}/v2/").status_code == 401


def test_a_slow_body_is_refused_and_its_upload_dropped(guarded: tuple[Server, str]) -> None:
    server, secret = guarded
    s = _connect(server)
    digest = "sha256:" + hashlib.sha256(b"a" * 100).hexdigest()
    s.sendall(f"POST /v2/team/slow/blobs/uploads/?digest={digest} HTTP/1.1\r\nHost: x\r\n"
              f"Authorization: Bearer {secret}\r\nContent-Length: 100\r\n\r\n".encode())
    start = time.monotonic()
    try:
        for _ in range(30):  # a byte every half second: 2 bytes in a 2 s window
            s.sendall(b"a")
            time.sleep(0.5)
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer = _answer(s)
    s.close()
    assert time.monotonic() - start < 8
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:100]
    uploads = Path(server.env["KVGRAFT_HOME"]) / "uploads"
    deadline = time.monotonic() + 5
    while list(uploads.glob(".mono-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(uploads.glob(".mono-*"))


def test_idle_connections_never_exhaust_descriptors(guarded: tuple[Server, str]) -> None:
    server, _ = guarded
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5)
            for _ in range(140)]
    # Those over the cap are answered 503 at once, the others closed after the head timeout
    # (2 s here); then the server serves again.
    time.sleep(3)
    assert requests.get(f"{server.url}/v2/", timeout=5).status_code == 401
    closed = 0
    for s in idle:
        s.settimeout(0.5)
        try:
            s.recv(4096)  # the answer or the end: not a timeout
            closed += 1
        except ConnectionResetError:
            closed += 1
        except TimeoutError:
            pass
        s.close()
    assert closed == len(idle)
    assert server.alive()

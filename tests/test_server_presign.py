"""`kvgraft serve --redirect-blobs` on a real S3 server (SeaweedFS): kvgraft clients get a
307 to a presigned URL and fetch blob bytes from the bucket, not through the server.

Clients reach the bucket through a TCP relay named by KVGRAFT_S3_PUBLIC_ENDPOINT_URL (the
endpoint clients see differs from the server's), which records what they send and can cut a
response short or hold it past the URL's expiry."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from kvgraft.blobstore.s3 import S3BlobStore
from kvgraft.blobstore.s3settings import S3Settings
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, Unavailable, UsageError
from kvgraft.reference import Reference
from kvgraft.remote.http import HttpRemote
from kvgraft.transfer.cache import Cache
from tests.support.harness import s3_base_url, unavailable
from tests.support.serve import Server, kvgraft, make_token, running_server, server_env
from tests.support.synthetic import write_synthetic

TEAM = "team/kv"
EXPIRY = 2  # seconds; SigV4 dates are whole seconds, so a URL lives 1 to 2 s


class Relay:
    """A TCP relay to the S3 server. The client keeps connections alive, so the relay
    splits what it is sent into requests (presigned GETs: headers, no body)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.requests: list[bytearray] = []  # each request a client sent
        self.cut_next: int | None = None  # forward this many response bytes, then close
        self.hold = 0.0  # seconds to stall before closing a cut response
        self.refuse = False  # close every connection at once
        self.delay = 0.0  # seconds to hold each request before passing it on
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        with self._lock:
            if self.refuse:
                conn.close()
                return
            cut, self.cut_next = self.cut_next, None
        upstream = socket.create_connection(self.target)

        def upward() -> None:
            pending = bytearray()
            try:
                while data := conn.recv(65536):
                    pending += data
                    while (end := pending.find(b"\r\n\r\n")) >= 0:
                        request, pending = pending[:end + 4], pending[end + 4:]
                        with self._lock:
                            self.requests.append(request)
                        time.sleep(self.delay)
                        upstream.sendall(request)
            except OSError:
                pass

        threading.Thread(target=upward, daemon=True).start()
        forwarded = 0
        try:
            while data := upstream.recv(65536):
                if cut is not None and forwarded + len(data) >= cut:
                    conn.sendall(data[:cut - forwarded])
                    time.sleep(self.hold)
                    break
                conn.sendall(data)
                forwarded += len(data)
        except OSError:
            pass
        finally:
            for s in (conn, upstream):
                # shutdown, not just close: the other thread's recv must end, and the
                # client must see the connection end where it was cut.
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self.listener.close()


@dataclass(frozen=True)
class Setup:
    server: Server
    relay: Relay
    src: Path
    store_url: str


@pytest.fixture(scope="module")
def s3_base() -> str:
    return s3_base_url()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, s3_base: str) -> Iterator[Setup]:
    import os

    home = tmp_path_factory.mktemp("presign")
    store_url = f"{s3_base}/{uuid.uuid4().hex}"
    endpoint = os.environ["AWS_ENDPOINT_URL_S3"].removeprefix("http://")
    host, port = endpoint.split(":")
    relay = Relay((host, int(port)))
    env = server_env(home / "home", KVGRAFT_BLOB_URL=store_url,
                     KVGRAFT_S3_PUBLIC_ENDPOINT_URL=relay.url)
    src = home / "graft.safetensors"
    write_synthetic(src, tokens=700)
    kvgraft(env, "push", str(src), f"{TEAM}:v1", "--chunk-tokens", "128")
    kvgraft(env, "push", str(src), "team/lost:v1", "--chunk-tokens", "256")
    with running_server(env, home / "server.log", "--redirect-blobs", "--redirect-expiry",
                        str(EXPIRY)) as server:
        yield Setup(server, relay, src, store_url)
        assert server.alive()
    relay.close()
    assert "Traceback" not in (home / "server.log").read_text()


def _stored_responses(server: Server) -> list[tuple[str, int]]:
    """(digest, status) of every stored-blob GET in the server's access log."""
    return [(m.group(1), int(m.group(2))) for m in re.finditer(
        r'"GET /kvgraft/v1/stored/(sha256:[0-9a-f]{64})\S* HTTP/1\.1" (\d{3})',
        server.log.read_text())]


def _remote(setup: Setup, name: str) -> HttpRemote:
    return HttpRemote(setup.server.url,
                      make_token(setup.server.env, name, f"repository:{TEAM}:pull"))


def _stored_url(setup: Setup, digest: Digest, repository: str = TEAM) -> str:
    return f"{setup.server.url}/kvgraft/v1/stored/{digest}?repository={repository}"


def test_pull_via_redirect_is_byte_identical_and_the_server_sends_no_blob_bytes(
        setup: Setup, tmp_path: Path) -> None:
    remote = _remote(setup, "node")
    before = len(_stored_responses(setup.server))
    seen = len(setup.relay.requests)
    digest, stats = remote.pull(TEAM + ":v1", Cache(tmp_path / "cache"), tmp_path / "out.kv")
    assert (tmp_path / "out.kv").read_bytes() == setup.src.read_bytes()
    served = _stored_responses(setup.server)[before:]
    assert stats.fetched > 1 and len(served) >= stats.fetched
    assert {status for _, status in served} == {307}  # not one 200 or 206: no blob bytes
    # Every blob came through the public endpoint, and never with the server's token.
    sent = [bytes(r) for r in setup.relay.requests[seen:]]
    assert len(sent) >= stats.fetched
    assert all(b"X-Amz-Signature=" in r and b"authorization:" not in r.lower() for r in sent)
    assert all(remote.token.encode() not in r for r in sent)
    pulls = [json.loads(line) for line in
             kvgraft(setup.server.env, "log", "--json", "--action", "pull").splitlines()]
    assert (pulls[-1]["actor"], pulls[-1]["digest"]) == ("token:node", str(digest))


def _first_chunk(setup: Setup, remote: HttpRemote, ref: str = TEAM + ":v1") -> Digest:
    reference = Reference.parse(ref)
    manifest = remote.manifest(reference.name, remote.resolve(reference))
    return manifest.chunks[0].digest


def _stored_bytes(setup: Setup, digest: Digest) -> bytes:
    bucket, _, prefix = setup.store_url.removeprefix("s3://").partition("/")
    return S3BlobStore(bucket, prefix).get(digest)


def test_a_cut_transfer_resumes_with_range_at_the_presigned_url(setup: Setup) -> None:
    remote = _remote(setup, "resumer")
    digest = _first_chunk(setup, remote)
    before = len(_stored_responses(setup.server))
    seen = len(setup.relay.requests)
    setup.relay.cut_next = 4096
    data = remote.store(TEAM).get(digest)
    assert data == _stored_bytes(setup, digest)
    first, second = (bytes(r) for r in setup.relay.requests[seen:seen + 2])
    assert b"range:" not in first.lower()
    assert re.search(rb"(?i)range: bytes=\d+-", second)
    # The same presigned URL both times: the resume did not go back to the server.
    assert first.split(b" ")[1] == second.split(b" ")[1]
    assert _stored_responses(setup.server)[before:] == [(str(digest), 307)]


def test_an_expired_url_is_asked_for_again(setup: Setup) -> None:
    remote = _remote(setup, "late")
    digest = _first_chunk(setup, remote)
    # The store itself refuses a URL past its expiry.
    location = requests.get(_stored_url(setup, digest), allow_redirects=False, timeout=10,
                            headers={"Authorization": f"Bearer {remote.token}"}
                            ).headers["Location"]
    time.sleep(EXPIRY + 1.5)
    assert requests.get(location, timeout=10).status_code == 403
    # A transfer that stalls past the expiry: the resume at the old URL is refused, and
    # the client gets a fresh one from the server and finishes.
    before = len(_stored_responses(setup.server))
    setup.relay.cut_next, setup.relay.hold = 4096, EXPIRY + 1.5
    try:
        data = remote.store(TEAM).get(digest)
    finally:
        setup.relay.hold = 0.0
    assert data == _stored_bytes(setup, digest)
    assert _stored_responses(setup.server)[before:] == [(str(digest), 307)] * 2


@pytest.mark.slow
def test_a_url_the_store_keeps_refusing_is_a_clear_unavailable(setup: Setup) -> None:
    remote = _remote(setup, "too-slow")
    digest = _first_chunk(setup, remote)
    before = len(_stored_responses(setup.server))
    setup.relay.delay = EXPIRY + 1.5  # every URL arrives at the store expired
    try:
        with pytest.raises(Unavailable, match="refused the URL the server redirected to: "
                                              "AccessDenied") as e:
            remote.store(TEAM).get(digest)
    finally:
        setup.relay.delay = 0.0
    assert e.value.exit_code == 7 and "127.0.0.1:" in e.value.message
    # Each try asked the server for a fresh URL.
    assert _stored_responses(setup.server)[before:] == [(str(digest), 307)] * 4


def test_cli_pull_through_a_redirecting_server_needs_no_s3_credentials(
        setup: Setup, tmp_path: Path) -> None:
    node = {k: v for k, v in server_env(tmp_path / "node").items()
            if not k.startswith("AWS_")}
    token_file = tmp_path / "token"
    token_file.write_text(make_token(setup.server.env, "cli", f"repository:{TEAM}:pull"))
    kvgraft(node, "remote", "add", "team", setup.server.url, "--token-file", str(token_file))
    out = tmp_path / "out.kv"
    pulled = json.loads(kvgraft(node, "--remote", "team", "pull", f"{TEAM}:v1", "-o", str(out),
                                "--json"))
    assert out.read_bytes() == setup.src.read_bytes() and pulled["fetched"] > 1
    setup.relay.refuse = True
    try:
        cut_off = subprocess.run([sys.executable, "-m", "kvgraft.cli", "--remote", "team",
                                  "pull", f"{TEAM}:v1", "-o", str(tmp_path / "again.kv")],
                                 env={**node, "KVGRAFT_CACHE": str(tmp_path / "cold")},
                                 capture_output=True, text=True)
    finally:
        setup.relay.refuse = False
    assert cut_off.returncode == 7, cut_off.stderr
    assert "cannot reach the blob store" in cut_off.stderr
    assert not (tmp_path / "again.kv").exists()


def test_an_unreachable_store_endpoint_is_a_clear_unavailable(setup: Setup) -> None:
    remote = _remote(setup, "cut-off")
    digest = _first_chunk(setup, remote)
    setup.relay.refuse = True
    try:
        with pytest.raises(Unavailable, match="cannot reach the blob store at 127.0.0.1:"
                                              f"{setup.relay.port}") as e:
            remote.store(TEAM).get(digest)
    finally:
        setup.relay.refuse = False
    assert e.value.exit_code == 7 and "KVGRAFT_S3_PUBLIC_ENDPOINT_URL" in e.value.human()


def test_a_blob_missing_from_the_bucket_is_an_integrity_failure(setup: Setup,
                                                                tmp_path: Path) -> None:
    remote = HttpRemote(setup.server.url, make_token(setup.server.env, "lost",
                                                     "repository:team/lost:pull"))
    digest = _first_chunk(setup, remote, "team/lost:v1")
    bucket, _, prefix = setup.store_url.removeprefix("s3://").partition("/")
    assert S3BlobStore(bucket, prefix).delete(digest)
    with pytest.raises(IntegrityError, match=f"blob {digest} is missing") as e:
        remote.pull("team/lost:v1", Cache(tmp_path / "cache"))
    assert e.value.exit_code == 4


def test_no_redirect_without_the_scope(setup: Setup) -> None:
    remote = _remote(setup, "scoped")
    digest = _first_chunk(setup, remote)
    other = make_token(setup.server.env, "other-team", "repository:other/*:pull")
    for headers, status in (({"Authorization": f"Bearer {other}"}, 403), ({}, 401),
                            ({"Authorization": "Bearer kvg_wrong"}, 401)):
        r = requests.get(_stored_url(setup, digest), headers=headers, allow_redirects=False,
                         timeout=10)
        assert r.status_code == status and "Location" not in r.headers
        assert "X-Amz" not in r.text
    # A repository the token may pull does not open another repository's blobs either.
    r = requests.get(_stored_url(setup, digest, "other/kv"), allow_redirects=False, timeout=10,
                     headers={"Authorization": f"Bearer {other}"})
    assert r.status_code == 404 and "Location" not in r.headers


def test_oci_clients_still_get_the_bytes_from_a_redirecting_server(setup: Setup,
                                                                   tmp_path: Path) -> None:
    import shutil

    skopeo = shutil.which("skopeo")
    if skopeo is None:
        unavailable("skopeo (Debian package)")
    assert skopeo is not None
    token = make_token(setup.server.env, "skopeo", f"repository:{TEAM}:pull")
    layout = tmp_path / "layout"
    subprocess.run([skopeo, "--insecure-policy", "copy", "--src-tls-verify=false",
                    "--src-creds", f"ci:{token}",
                    f"docker://127.0.0.1:{setup.server.port}/{TEAM}:v1", f"oci:{layout}:v1"],
                   check=True, capture_output=True, text=True, timeout=120)
    index = json.loads((layout / "index.json").read_text())
    manifest_path = layout / "blobs" / "sha256" / index["manifests"][0]["digest"][7:]
    oci = json.loads(manifest_path.read_bytes())
    for desc in [oci["config"], *oci["layers"]]:
        blob = (layout / "blobs" / "sha256" / desc["digest"][7:]).read_bytes()
        assert "sha256:" + hashlib.sha256(blob).hexdigest() == desc["digest"]
        assert len(blob) == desc["size"]
    # The OCI blob path sends the bytes itself: the store holds none in the form OCI names.
    r = requests.get(f"{setup.server.url}/v2/{TEAM}/blobs/{oci['layers'][-1]['digest']}",
                     auth=("ci", token), allow_redirects=False, timeout=10)
    assert r.status_code == 200
    assert "sha256:" + hashlib.sha256(r.content).hexdigest() == oci["layers"][-1]["digest"]


def test_a_local_store_falls_back_to_sending_the_bytes(tmp_path: Path) -> None:
    env = server_env(tmp_path / "home")
    src = write_synthetic(tmp_path / "graft.safetensors", tokens=300)
    kvgraft(env, "push", str(src), f"{TEAM}:v1", "--chunk-tokens", "128")
    with running_server(env, tmp_path / "server.log", "--redirect-blobs") as server:
        remote = HttpRemote(server.url, make_token(env, "node", f"repository:{TEAM}:pull"))
        _, stats = remote.pull(TEAM + ":v1", Cache(tmp_path / "cache"), tmp_path / "out.kv")
        assert (tmp_path / "out.kv").read_bytes() == src.read_bytes()
        served = _stored_responses(server)
        assert len(served) == stats.fetched and {s for _, s in served} == {200}
    assert "cannot presign URLs; blob bytes go through the server" in \
        (tmp_path / "server.log").read_text()


def test_presign_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match="KVGRAFT_S3_PUBLIC_ENDPOINT_URL"):
        S3Settings.from_env({"KVGRAFT_S3_PUBLIC_ENDPOINT_URL": "s3.example.org"})
    settings = S3Settings.from_env({"KVGRAFT_S3_ENDPOINT_URL": "http://10.0.0.1:8333",
                                    "KVGRAFT_S3_PUBLIC_ENDPOINT_URL":
                                        "https://s3.example.org"})
    store = S3BlobStore("bucket", "team", settings=settings)
    digest = Digest.of(b"x")
    url = store.presign(digest, 60)
    # Signed for the endpoint clients reach, with SigV4 and the expiry asked for.
    assert url.startswith(f"https://s3.example.org/bucket/team/sha256/{digest.hex[:2]}/")
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in url and "X-Amz-Expires=60" in url
    for bad in (0, 8 * 24 * 3600):
        with pytest.raises(UsageError, match="presigned URL lives"):
            store.presign(digest, bad)


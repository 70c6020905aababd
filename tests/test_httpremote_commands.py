"""Every command through `kvgraft remote add NAME http://… --token-file F`, run as a user
runs it (the real CLI in a subprocess) against a real `kvgraft serve`: the same results and
exit codes as a direct remote, scopes enforced by the server, events recorded there under
the token's name, and blob transfers that survive a connection cut mid-way."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from kvgraft.blobstore.memory import MemoryBlobStore
from kvgraft.catalog.records import EventRecord, PushRecord
from kvgraft.errors import AuthRefused, IntegrityError, Unavailable, UsageError
from kvgraft.reference import Reference
from kvgraft.remote.catalog import HttpCatalog
from kvgraft.remote.http import HttpRemote
from kvgraft.transfer.push import PushOptions, build_artifact
from tests.support.serve import Server, free_port, kvgraft, make_token, running_server, server_env
from tests.support.synthetic import write_synthetic

TEAM = "repository:team/*:pull,push,delete"


@dataclass(frozen=True)
class Setup:
    server: Server
    node: dict[str, str]
    src: Path
    root: Path
    tokens: dict[str, str]


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env,
                          capture_output=True, text=True)


def ok(env: dict[str, str], *args: str) -> str:
    done = run(env, *args)
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout


def lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def stored_blobs(server: Server) -> set[str]:
    root = Path(server.env["KVGRAFT_HOME"]) / "blobs"
    return {p.name for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("served")
    env = server_env(root / "server")
    src = write_synthetic(root / "graft.kv", tokens=700)
    tokens = {"team-rw": make_token(env, "team-rw", TEAM),
              "team-ro": make_token(env, "team-ro", "repository:team/*:pull"),
              "elsewhere": make_token(env, "elsewhere", "repository:x/*:pull,push")}
    node = server_env(root / "node")
    with running_server(env, root / "server.log") as server:
        for remote, token in (("team", "team-rw"), ("ro", "team-ro"), ("other", "elsewhere")):
            (root / f"{token}.token").write_text(tokens[token] + "\n")
            kvgraft(node, "remote", "add", remote, server.url, "--token-file",
                    str(root / f"{token}.token"))
        yield Setup(server, node, src, root, tokens)
        assert server.alive()
    assert "Traceback" not in (root / "server.log").read_text()


def test_push_pull_ls_inspect_tag_verify_sign_audit_log(setup: Setup, tmp_path: Path) -> None:
    node, t = setup.node, ["--remote", "team"]
    pushed = json.loads(ok(node, *t, "push", str(setup.src), "team/kv:v1", "--json",
                           "--chunk-tokens", "128", "--label", "task=demo"))
    digest = pushed["digest"]
    assert pushed["blobs_stored"] > 0
    again = json.loads(ok(node, *t, "push", str(setup.src), "team/kv:v1", "--json",
                          "--chunk-tokens", "128"))
    assert again["digest"] == digest and again["blobs_stored"] == 0  # nothing sent twice
    out = tmp_path / "out.kv"
    pulled = json.loads(ok(node, *t, "pull", "team/kv:v1", "-o", str(out), "--json"))
    assert out.read_bytes() == setup.src.read_bytes() and pulled["digest"] == digest

    listed = lines(ok(node, *t, "ls", "team/*", "--json"))
    assert [(e["repository"], e["tag"], e["digest"]) for e in listed] == \
        [("team/kv", "v1", digest)]
    inspected = json.loads(ok(node, *t, "inspect", "team/kv:v1", "--json"))
    assert inspected["digest"] == digest and inspected["labels"] == {"task": "demo"}
    assert inspected["tags"] == ["team/kv:v1"] and inspected["stored_size"] > 0
    assert all(c["codec"] for c in inspected["chunks"])  # rows the server derived

    ok(node, *t, "tag", "team/kv:v1", "team/kv:stable")
    assert {e["tag"] for e in lines(ok(node, *t, "ls", "--json"))} == {"v1", "stable"}
    ok(node, *t, "untag", "team/kv:stable")
    assert {e["tag"] for e in lines(ok(node, *t, "ls", "--json"))} == {"v1"}
    assert run(node, *t, "untag", "team/kv:stable").returncode == 3

    ok(node, *t, "verify", "team/kv:v1")
    ok(node, *t, "verify", "--all")
    keyid = ok(node, "key", "generate", "alice").strip()
    signed = json.loads(ok(node, *t, "sign", "team/kv:v1", "--key", "alice", "--json"))
    assert signed["digest"] == digest and signed["keyid"] == keyid
    audit = json.loads(ok(node, *t, "audit", "team/kv:v1", "--json"))
    assert [(a["signers"], a["ok"]) for a in audit["attestations"]] == [([keyid], True)]
    assert ok(node, *t, "pull", "team/kv:v1", "--require-signed-by", "alice", "--json")

    # Offline, the pull is served from the machine cache: the server is not asked.
    kvgraft(node, "remote", "add", "gone", "http://127.0.0.1:9", "--token-file",
            str(setup.root / "team-rw.token"))
    offline = tmp_path / "offline.kv"
    ok(node, "--remote", "gone", "--offline", "pull", "team/kv:v1", "-o", str(offline))
    assert offline.read_bytes() == setup.src.read_bytes()
    assert run(node, "--remote", "gone", "ls").returncode == 7  # online, it is unreachable

    events = lines(ok(node, *t, "log", "team/kv:v1", "--json"))
    assert {e["action"] for e in events} >= {"push", "pull", "tag", "untag", "verify", "sign"}
    assert {e["actor"] for e in events} == {"token:team-rw"}  # never the client's user
    # The server's own catalog holds the same events, recorded by the server.
    direct = lines(kvgraft(setup.server.env, "log", "team/kv:v1", "--json"))
    assert [e["id"] for e in direct] == [e["id"] for e in events]


def test_scopes_are_enforced_and_nothing_is_stored(setup: Setup) -> None:
    node = setup.node
    ok(node, "--remote", "team", "push", str(setup.src), "team/scoped:v1")
    before = stored_blobs(setup.server)
    other = write_synthetic(setup.root / "other.kv", tokens=300, seed=7)
    refused = run(node, "--remote", "ro", "push", str(other), "team/ro-push:v1")
    assert refused.returncode == 8, refused.stderr
    assert "no push scope on team/ro-push" in refused.stderr
    outside = run(node, "--remote", "other", "push", str(other), "team/x:v1")
    assert outside.returncode == 8, outside.stderr
    assert stored_blobs(setup.server) == before
    assert lines(ok(node, "--remote", "team", "ls", "team/ro-push", "--json")) == []
    assert run(node, "--remote", "other", "pull", "team/scoped:v1").returncode == 8
    assert run(node, "--remote", "other", "inspect", "team/scoped:v1").returncode == 8
    assert run(node, "--remote", "other", "ls", "--json").stdout == ""  # sees nothing
    # Reading is not writing: a pull-only token cannot tag or untag either.
    assert run(node, "--remote", "ro", "tag", "team/scoped:v1", "team/scoped:x").returncode == 8
    assert run(node, "--remote", "ro", "untag", "team/scoped:v1").returncode == 8
    assert {e["tag"] for e in lines(ok(node, "--remote", "ro", "ls", "team/scoped",
                                       "--json"))} == {"v1"}
    # The whole event log is for admins.
    assert run(node, "--remote", "team", "log").returncode == 8


def test_what_only_a_direct_remote_can_do_is_refused_by_name(setup: Setup) -> None:
    gc = run(setup.node, "--remote", "team", "gc", "--dry-run")  # the server's, for admins
    assert gc.returncode == 8 and "admin" in gc.stderr, gc.stderr
    # Tokens and schema migrations belong to the server's catalog: refused by name, and no
    # local catalog is made on the client instead.
    for args in (["token", "create", "--scope", "repository:team/*:pull"], ["token", "ls"],
                 ["token", "revoke", "team-ro"], ["db", "upgrade"], ["db", "current"]):
        done = run(setup.node, "--remote", "team", *args)
        assert done.returncode == 2, (args, done.stderr)
        assert "cannot run through the kvgraft server" in done.stderr
        assert setup.server.url in done.stderr and "Traceback" not in done.stderr
    assert not list(Path(setup.node["KVGRAFT_HOME"]).glob("*.db"))
    ok(setup.node, "--remote", "team", "push", str(setup.src), "team/repair:v1")
    repair = run(setup.node, "--remote", "team", "verify", "team/repair:v1", "--repair")
    assert repair.returncode in (0, 2)  # nothing bad: repair has nothing to do
    store = HttpRemote(setup.server.url, setup.tokens["team-rw"]).store("team/repair")
    with pytest.raises(UsageError, match="raw blobs"):
        list(store.iter())


def test_a_manifest_naming_missing_blobs_is_refused(setup: Setup) -> None:
    """The server derives blob rows from what it holds: a manifest whose blobs were never
    uploaded is refused (exit 4) and leaves nothing behind."""
    path = write_synthetic(setup.root / "half.kv", tokens=400, seed=11)
    upload = build_artifact(path, MemoryBlobStore(), PushOptions())
    catalog = HttpCatalog(HttpRemote(setup.server.url, setup.tokens["team-rw"]))
    event = EventRecord("push", "root@forged", "forged")
    with pytest.raises(IntegrityError) as refused:
        catalog.record_push(PushRecord(upload.manifest, upload.blobs, "team/half", "v1", {},
                                       event))
    assert refused.value.exit_code == 4 and "does not hold" in refused.value.message
    assert lines(ok(setup.node, "--remote", "team", "ls", "team/half", "--json")) == []
    assert not any(e["repository"] == "team/half" for e in
                   lines(kvgraft(setup.server.env, "log", "--json")))


def test_an_upload_is_visible_only_once_it_hashes_to_its_digest(setup: Setup,
                                                               tmp_path: Path) -> None:
    path = write_synthetic(tmp_path / "u.kv", tokens=600, seed=21)
    mem = MemoryBlobStore()
    chunks = [c.digest for c in build_artifact(path, mem, PushOptions()).manifest.chunks]
    store = HttpRemote(setup.server.url, setup.tokens["team-rw"]).store("team/uploads")
    before = stored_blobs(setup.server)
    with pytest.raises(IntegrityError) as wrong:  # another blob's bytes under this digest
        store.put(chunks[0], [mem.get(chunks[1])])
    assert wrong.value.exit_code == 4
    with pytest.raises(IntegrityError):  # truncated
        store.put(chunks[0], [mem.get(chunks[0])[:-100]])
    # A body larger than its declared size can take is cut off at the limit (413).
    answer = requests.put(f"{setup.server.url}/kvgraft/v1/upload/{chunks[0]}",
                          params={"repository": "team/uploads", "size": "10"},
                          data=mem.get(chunks[0]), timeout=30,
                          headers={"Authorization": f"Bearer {setup.tokens['team-rw']}"})
    assert answer.status_code == 413 and answer.json()["errors"][0]["code"] == "SIZE_INVALID"
    assert stored_blobs(setup.server) == before and store.stat(chunks[0]) is None
    reader = HttpRemote(setup.server.url, setup.tokens["team-ro"]).store("team/uploads")
    with pytest.raises(AuthRefused):
        reader.put(chunks[0], [mem.get(chunks[0])])
    assert store.put(chunks[0], [mem.get(chunks[0])]) is True
    assert store.put(chunks[0], [mem.get(chunks[0])]) is False  # the first copy wins
    info = store.stat(chunks[0])
    assert info is not None and info.stored_size == len(mem.get(chunks[0]))
    assert reader.stat(chunks[0]) is not None  # the repository holds it now
    assert HttpRemote(setup.server.url, setup.tokens["team-rw"]).store(
        "team/elsewhere").stat(chunks[0]) is None  # another repository does not


def test_a_client_cannot_forge_the_actor_or_a_push_event(setup: Setup) -> None:
    ok(setup.node, "--remote", "team", "push", str(setup.src), "team/ev:v1")
    catalog = HttpCatalog(HttpRemote(setup.server.url, setup.tokens["team-ro"]))
    digest = catalog.resolve(Reference.parse("team/ev:v1"))
    catalog.add_event(EventRecord("pull", "root@forged", "forged", repository="team/ev",
                                  digest=digest))
    with pytest.raises(UsageError):
        catalog.add_event(EventRecord("push", "root@forged", "forged", repository="team/ev",
                                      digest=digest))
    events = [e for e in catalog.events(digest=digest) if e.repository == "team/ev"]
    assert [(e.action, e.actor) for e in events] == \
        [("push", "token:team-rw"), ("pull", "token:team-ro")]
    assert all("forged" not in e.host for e in events)


def test_copy_from_and_to_the_server(setup: Setup, tmp_path: Path) -> None:
    node = setup.node
    local = setup.root / "local"
    kvgraft(node, "remote", "add", "mine", "--catalog", f"sqlite:///{local}/catalog.db",
            "--store", (local / "blobs").as_uri())
    kvgraft(node, "--remote", "mine", "db", "upgrade")
    ok(node, "--remote", "team", "push", str(setup.src), "team/cp:v1")
    ok(node, "--remote", "team", "copy", "team/cp:v1", "mine/mirror/cp:v1")
    out = tmp_path / "local.kv"
    ok(node, "--remote", "mine", "pull", "mirror/cp:v1", "-o", str(out))
    assert out.read_bytes() == setup.src.read_bytes()
    copied = json.loads(ok(node, "--remote", "mine", "copy", "mirror/cp:v1",
                           "team/team/back:v1", "--json"))
    assert copied["blobs"] > 0
    back = tmp_path / "back.kv"
    ok(node, "--remote", "team", "pull", "team/back:v1", "-o", str(back))
    assert back.read_bytes() == setup.src.read_bytes()
    events = lines(ok(node, "--remote", "team", "log", "team/back:v1", "--json",
                      "--action", "copy"))
    # the copy out of team/cp, then the copy into team/back: both the server's, by token
    assert [(e["actor"], e["repository"]) for e in events] == \
        [("token:team-rw", "team/cp"), ("token:team-rw", "team/back")]


def test_oci_mirror_from_and_into_an_http_remote(setup: Setup, tmp_path: Path) -> None:
    """`copy` to and from an OCI registry (here the server's own /v2/) with the current
    registry an HTTP remote: the blobs come from and go to the server's repositories."""
    node, t = setup.node, ["--remote", "team"]
    src = write_synthetic(tmp_path / "oci.kv", tokens=500, seed=5)
    ok(node, *t, "push", str(src), "team/oci-src:v1")
    target = f"oci+http://127.0.0.1:{setup.server.port}/team/oci-mirror:v1"
    creds = ["--token-file", str(setup.root / "team-rw.token")]
    sent = json.loads(ok(node, *t, "copy", "team/oci-src:v1", target, *creds, "--json"))
    back = json.loads(ok(node, *t, "copy", target, "team/oci-back:v1", *creds, "--json"))
    assert back["digest"] == sent["digest"]
    out = tmp_path / "out.kv"
    ok(node, *t, "pull", "team/oci-back:v1", "-o", str(out))
    assert out.read_bytes() == src.read_bytes()


def test_a_remote_that_is_not_a_kvgraft_server_is_unavailable(tmp_path: Path) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>a web page</html>")

        def log_message(self, *args: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Page) as web:
        threading.Thread(target=web.serve_forever, daemon=True).start()
        catalog = HttpCatalog(HttpRemote(f"http://127.0.0.1:{web.server_port}", "kvg_x"))
        with pytest.raises(Unavailable, match="not JSON") as e:
            catalog.artifact_digests()
        assert e.value.exit_code == 7
        web.shutdown()


class CuttingProxy:
    """A TCP proxy in front of the server that, once in each direction, closes a
    connection after `cut` bytes went that way: a transfer broken mid-blob."""

    def __init__(self, target: int, cut: int) -> None:
        self.target, self.cut = target, cut
        self.port = free_port()
        self.cuts: list[str] = []
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b, way in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(target=self._pump, args=(a, b, way, (client, upstream)),
                                 daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, way: str,
              both: tuple[socket.socket, socket.socket]) -> None:
        sent = 0
        try:
            while data := a.recv(8192):
                with self._lock:
                    cutting = way not in self.cuts and sent + len(data) > self.cut
                    if cutting:
                        self.cuts.append(way)
                if cutting:
                    b.sendall(data[:self.cut - sent])
                    break
                b.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in both:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._sock.close()


def test_transfers_cut_mid_way_resume(setup: Setup, tmp_path: Path) -> None:
    proxy = CuttingProxy(setup.server.port, cut=20_000)
    try:
        kvgraft(setup.node, "remote", "add", "flaky", f"http://127.0.0.1:{proxy.port}",
                "--token-file", str(setup.root / "team-rw.token"))
        src = write_synthetic(tmp_path / "flaky.kv", tokens=900, seed=3)
        ok(setup.node, "--remote", "flaky", "push", str(src), "team/flaky:v1")
        assert proxy.cuts == ["up"]  # an upload was cut and sent again
        out = tmp_path / "out.kv"
        fresh = {**setup.node, "KVGRAFT_CACHE": str(tmp_path / "fresh-cache")}
        ok(fresh, "--remote", "flaky", "pull", "team/flaky:v1", "-o", str(out))
        assert proxy.cuts == ["up", "down"]  # a download was cut and resumed
        assert out.read_bytes() == src.read_bytes()
    finally:
        proxy.close()


@pytest.mark.slow
def test_capture_graft_and_match_through_the_server(setup: Setup, tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="grafting needs the [hf] extra (torch)")
    pytest.importorskip("transformers", reason="grafting needs the [hf] extra (transformers)")
    from tests.support.tinymodels import build

    model = str(build(tmp_path / "llama", "llama"))
    text = "Keep the light burning from sunset to sunrise. "
    t = ["--remote", "team"]
    captured = json.loads(ok(setup.node, *t, "capture", "team/doc:v1", "--model", model,
                             "--text", text, "--json"))
    digest = captured["digest"]
    grafted = run(setup.node, *t, "graft", "team/doc:v1", "--model", model, "--text",
                  "And then?", "--max-new-tokens", "4")
    assert grafted.returncode == 0, grafted.stderr
    found = json.loads(ok(setup.node, *t, "match", "--model", model, "--text",
                          text + "And then?", "--json"))["match"]
    assert found["digest"] == digest and found["references"] == ["team/doc:v1"]
    # What the token may not read is not found: another repository's token sees nothing.
    hidden = json.loads(ok(setup.node, "--remote", "other", "match", "--model", model,
                           "--text", text + "And then?", "--json"))
    assert hidden["match"] is None
    events = lines(ok(setup.node, *t, "log", "team/doc:v1", "--json"))
    assert events[0]["action"] == "push" and {e["actor"] for e in events} == {"token:team-rw"}


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.s3
def test_commands_through_a_server_on_postgres_and_s3(tmp_path: Path, postgres_url: str,
                                                       s3_store_url: str) -> None:
    """The server-side queries behind the HTTP remote, on the shared deployment's backends."""
    env = server_env(tmp_path / "server", KVGRAFT_CATALOG_URL=postgres_url,
                     KVGRAFT_BLOB_URL=s3_store_url)
    kvgraft(env, "db", "upgrade")
    (tmp_path / "rw.token").write_text(make_token(env, "pg-rw", TEAM))
    node = server_env(tmp_path / "node")
    src = write_synthetic(tmp_path / "g.kv", tokens=700)
    with running_server(env, tmp_path / "server.log") as server:
        kvgraft(node, "remote", "add", "pg", server.url, "--token-file",
                str(tmp_path / "rw.token"))
        t = ["--remote", "pg"]
        digest = json.loads(ok(node, *t, "push", str(src), "team/pg:v1", "--json"))["digest"]
        ok(node, *t, "tag", "team/pg:v1", "team/pg:stable")
        assert {(e["tag"], e["digest"]) for e in lines(ok(node, *t, "ls", "--json"))} == \
            {("v1", digest), ("stable", digest)}
        out = tmp_path / "out.kv"
        ok(node, *t, "pull", "team/pg:stable", "-o", str(out))
        assert out.read_bytes() == src.read_bytes()
        ok(node, *t, "verify", "--all")
        audit = json.loads(ok(node, *t, "audit", "team/pg:v1", "--json"))
        assert audit["ok"] and audit["digest"] == digest
        assert {e["actor"] for e in lines(ok(node, *t, "log", "team/pg:v1", "--json"))} == \
            {"token:pg-rw"}
    assert "Traceback" not in (tmp_path / "server.log").read_text()

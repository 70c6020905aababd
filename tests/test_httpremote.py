"""Pulling through `kvgraft serve` with a token: byte-identical file, machine cache (a
second pull transfers nothing), verified bytes, and refusals with their exit codes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgraft.blobstore.base import blob_path
from kvgraft.errors import AuthRefused, IntegrityError, NotFound
from kvgraft.formats.manifest import Manifest
from kvgraft.reference import Reference
from kvgraft.remote.http import HttpRemote
from kvgraft.transfer.cache import Cache
from tests.support.serve import Server, kvgraft, make_token, running_server, server_env
from tests.support.synthetic import write_synthetic


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    home = tmp_path_factory.mktemp("remote")
    env = server_env(home / "home")
    src = home / "graft.safetensors"
    write_synthetic(src, tokens=700)
    kvgraft(env, "push", str(src), "team/kv:v1", "--chunk-tokens", "128")
    kvgraft(env, "push", str(src), "team/broken:v1", "--chunk-tokens", "256")
    with running_server(env, home / "server.log") as server:
        yield server, src


def test_pull_is_byte_identical_and_cached(served: tuple[Server, Path], tmp_path: Path) -> None:
    server, src = served
    remote = HttpRemote(server.url, make_token(server.env, "node", "repository:team/kv:pull"))
    cache = Cache(tmp_path / "cache")
    digest, stats = remote.pull("team/kv:v1", cache, tmp_path / "out.kv")
    assert hashlib.sha256((tmp_path / "out.kv").read_bytes()).digest() == \
        hashlib.sha256(src.read_bytes()).digest()
    assert stats.fetched > 0 and stats.fetched_bytes > 0
    again, stats2 = remote.pull("team/kv:v1", cache, tmp_path / "out2.kv")
    assert again == digest and stats2.fetched == 0 and stats2.cached == stats.fetched
    assert (tmp_path / "out2.kv").read_bytes() == src.read_bytes()
    pulls = [json.loads(line) for line in
             kvgraft(server.env, "log", "--json", "--action", "pull").splitlines()]
    assert [(e["actor"], e["repository"], e["digest"]) for e in pulls] == \
        [("token:node", "team/kv", str(digest))] * 2


def test_refusals_carry_their_exit_codes(served: tuple[Server, Path], tmp_path: Path) -> None:
    server, _ = served
    cache = Cache(tmp_path / "cache")
    other = HttpRemote(server.url, make_token(server.env, "elsewhere", "repository:x/*:pull"))
    with pytest.raises(AuthRefused) as refused:
        other.pull("team/kv:v1", cache)
    assert refused.value.exit_code == 8
    with pytest.raises(AuthRefused):
        HttpRemote(server.url, "kvg_not-a-token").pull("team/kv:v1", cache)
    reader = HttpRemote(server.url, make_token(server.env, "reader", "repository:team/*:pull"))
    with pytest.raises(NotFound) as missing:
        reader.pull("team/kv:nope", cache)
    assert missing.value.exit_code == 3


def test_corrupt_stored_blob_is_refused_by_the_client(served: tuple[Server, Path],
                                                      tmp_path: Path) -> None:
    server, _ = served
    remote = HttpRemote(server.url, make_token(server.env, "checker", "repository:team/*:pull"))
    digest = remote.resolve(Reference.parse("team/broken:v1"))
    manifest: Manifest = remote.manifest("team/broken", digest)
    chunk = manifest.chunks[-1].digest
    path = Path(server.env["KVGRAFT_HOME"]) / "blobs" / blob_path(chunk)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    cache = Cache(tmp_path / "cache")
    with pytest.raises(IntegrityError):
        remote.pull("team/broken:v1", cache, tmp_path / "out.kv")
    assert not (tmp_path / "out.kv").exists()
    assert not cache.has(chunk)


def test_cli_pull_through_an_http_remote(served: tuple[Server, Path], tmp_path: Path) -> None:
    server, src = served
    node = server_env(tmp_path / "node")
    token_file = tmp_path / "token"
    token_file.write_text(make_token(server.env, "cli-node", "repository:team/*:pull") + "\n")
    kvgraft(node, "remote", "add", "team", server.url, "--token-file", str(token_file))
    out = tmp_path / "out.kv"
    pulled = json.loads(kvgraft(node, "--remote", "team", "pull", "team/kv:v1", "-o", str(out),
                                "--json"))
    assert out.read_bytes() == src.read_bytes() and pulled["fetched"] > 0
    again = json.loads(kvgraft(node, "--remote", "team", "pull", "team/kv:v1", "--json"))
    assert again["fetched"] == 0 and again["digest"] == pulled["digest"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=node,
                              capture_output=True, text=True)

    listed = run("--remote", "team", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {json.loads(line)["repository"] for line in listed.stdout.splitlines()} == \
        {"team/kv", "team/broken"}
    token_file.write_text("kvg_revoked-or-wrong\n")
    refused = run("--remote", "team", "pull", "team/kv:v1")
    assert refused.returncode == 8, refused.stderr
    assert not (Path(node["KVGRAFT_HOME"]) / "catalog.db").exists()  # nothing local touched

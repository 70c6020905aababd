from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvgraft.cli.main import cli
from kvgraft.errors import NotFound
from tests.support.harness import RegistryFactory
from tests.support.synthetic import write_synthetic


def test_offline_pull_serves_the_cache_without_catalog_or_store(
        make_registry: RegistryFactory, tmp_path: Path) -> None:
    reg = make_registry()
    src = write_synthetic(tmp_path / "a.kv", tokens=500)
    digest = reg.push(src, "t/a:v1").digest
    reg.pull("t/a:v1")
    # Offline, with a catalog and a store that do not exist: nothing may touch them.
    offline = make_registry(catalog_url="postgresql+psycopg://nobody@127.0.0.1:1/x",
                            blob_url="file:///nonexistent/store")
    offline = type(offline)(replace(offline.config, offline=True))
    out = offline.pull("t/a:v1", tmp_path / "o.kv")
    assert out.digest == digest and out.stats.fetched == 0
    assert (tmp_path / "o.kv").read_bytes() == src.read_bytes()
    assert offline.pull(f"t/a@{digest}").digest == digest
    with pytest.raises(NotFound, match="offline"):
        offline.pull("t/other:v1")
    assert "catalog" not in offline.__dict__ and "store" not in offline.__dict__


def test_offline_env_and_missing_blob(cli_env: dict[str, str], tmp_path: Path) -> None:
    runner = CliRunner(env=cli_env)
    src = write_synthetic(tmp_path / "a.kv", tokens=500)
    assert runner.invoke(cli, ["push", str(src), "t/a"]).exit_code == 0
    # Pushed but never pulled: the manifest is known, the blobs are not in the cache.
    offline = CliRunner(env={**cli_env, "KVGRAFT_OFFLINE": "1"})
    r = offline.invoke(cli, ["pull", "t/a", "-o", str(tmp_path / "o.kv")])
    assert r.exit_code == 3 and "offline" in r.output
    assert runner.invoke(cli, ["pull", "t/a"]).exit_code == 0
    r = offline.invoke(cli, ["pull", "t/a", "-o", str(tmp_path / "o.kv"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["fetched"] == 0


def test_interrupted_pull_resumes_from_verified_chunks(make_registry: RegistryFactory,
                                                       tmp_path: Path) -> None:
    reg = make_registry()
    digest = reg.push(write_synthetic(tmp_path / "a.kv", tokens=1500), "t/a").digest
    manifest = reg.manifest(digest)
    puller = make_registry(cache_dir=tmp_path / "c2")
    # Simulate a pull that died after three blobs: exactly those are in the cache.
    for ref in manifest.blobs()[:3]:
        data = puller.store.get(ref.digest)
        from kvgraft.transfer.pull import verify_stored

        puller.cache.put(ref.digest, verify_stored(ref, data, "test"))
    result = puller.pull("t/a", tmp_path / "o.kv")
    assert result.stats.fetched == len(manifest.blobs()) - 3
    assert (tmp_path / "o.kv").read_bytes() == (tmp_path / "a.kv").read_bytes()


def test_concurrent_pulls_in_processes_share_one_cache(make_registry: RegistryFactory,
                                                       cli_env: dict[str, str],
                                                       tmp_path: Path) -> None:
    reg = make_registry(home=Path(cli_env["KVGRAFT_HOME"]),
                        cache_dir=Path(cli_env["KVGRAFT_CACHE"]))
    src = write_synthetic(tmp_path / "a.kv", tokens=3000, num_layers=8)
    reg.push(src, "t/a")
    procs = [subprocess.Popen([sys.executable, "-m", "kvgraft.cli",
                               "pull", "t/a", "-o", str(tmp_path / f"o{i}.kv"), "--json"],
                              env={**cli_env, "KVGRAFT_CACHE": str(tmp_path / "shared")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    for i in range(4):
        assert (tmp_path / f"o{i}.kv").read_bytes() == src.read_bytes()
    fetched = sum(json.loads(out)["fetched"] for out, _ in results)
    blobs = len(reg.manifest(reg.resolve("t/a")).blobs())
    assert fetched == blobs  # the fetch locks let each blob be fetched once
    leftovers = [p for p in (tmp_path / "shared").rglob("*.tmp")]
    assert leftovers == []


def test_cache_ls_and_prune(cli_env: dict[str, str], tmp_path: Path) -> None:
    runner = CliRunner(env=cli_env)
    a = write_synthetic(tmp_path / "a.kv", tokens=500, seed=1)
    b = write_synthetic(tmp_path / "b.kv", tokens=500, seed=2)
    for src, ref in ((a, "t/a"), (b, "t/b")):
        assert runner.invoke(cli, ["push", str(src), ref]).exit_code == 0
        assert runner.invoke(cli, ["pull", ref]).exit_code == 0
    listing = runner.invoke(cli, ["cache", "ls", "--json"]).stdout
    rows = [json.loads(x) for x in listing.splitlines()]
    assert sorted(r["refs"][0] for r in rows) == ["t/a:latest", "t/b:latest"]
    assert all(r["complete"] for r in rows)
    r = runner.invoke(cli, ["cache", "prune", "--json"])
    assert json.loads(r.stdout)["blobs"] == 0  # everything is still needed
    r = runner.invoke(cli, ["cache", "prune", "--all", "--dry-run", "--json"])
    assert json.loads(r.stdout)["artifacts"] == 2
    assert len(runner.invoke(cli, ["cache", "ls", "--json"]).stdout.splitlines()) == 2
    r = runner.invoke(cli, ["cache", "prune", "--older-than", "0s", "--json"])
    report = json.loads(r.stdout)
    assert report["artifacts"] == 2 and report["blobs"] == 8 and report["bytes_freed"] > 0
    assert runner.invoke(cli, ["cache", "ls", "--json"]).stdout == ""
    assert runner.invoke(cli, ["cache", "prune", "--older-than", "soon"]).exit_code == 2
    # The registry itself is untouched: a pull fetches again.
    r = runner.invoke(cli, ["pull", "t/a", "--json"])
    assert json.loads(r.stdout)["fetched"] == 4


def test_fetch_locks_are_a_bounded_set_and_prune_clears_the_old_ones(
        make_registry: RegistryFactory, tmp_path: Path) -> None:
    reg = make_registry()
    reg.push(write_synthetic(tmp_path / "a.kv", tokens=1500), "t/a")
    locks = reg.cache.root / "locks"
    locks.mkdir(parents=True)
    old = locks / f"{'ab' * 32}.lock"  # one blob's lock file, as earlier versions left it
    old.touch()
    result = reg.pull("t/a", tmp_path / "o.kv")
    fetched = {r.digest.hex[:3] for r in reg.manifest(result.digest).blobs()}
    assert sorted(p.name for p in locks.iterdir()) == sorted(
        [old.name, *(f"{h}.lock" for h in fetched)])
    reg.cache.prune()  # everything is still needed: only the old lock goes
    assert sorted(p.name for p in locks.iterdir()) == sorted(f"{h}.lock" for h in fetched)
    assert (tmp_path / "o.kv").read_bytes() == (tmp_path / "a.kv").read_bytes()


def test_prune_goes_on_when_the_locks_cannot_be_read(make_registry: RegistryFactory,
                                                     tmp_path: Path) -> None:
    reg = make_registry()
    reg.cache.root.mkdir(parents=True, exist_ok=True)
    (reg.cache.root / "locks").write_text("not a directory")
    assert reg.cache.prune().artifacts == 0
    assert (reg.cache.root / "locks").read_text() == "not a directory"


@pytest.mark.parametrize("form", ["subcommand", "global", "env"])
def test_every_offline_form_serves_the_cache_alone(cli_env: dict[str, str], tmp_path: Path,
                                                    form: str) -> None:
    runner = CliRunner(env=cli_env)
    src = write_synthetic(tmp_path / "a.kv", tokens=300)
    assert runner.invoke(cli, ["push", str(src), "t/a:v1"]).exit_code == 0
    assert runner.invoke(cli, ["pull", "t/a:v1"]).exit_code == 0
    # Neither the catalog nor the store can be reached now: only the cache can answer.
    gone = {**cli_env, "KVGRAFT_CATALOG_URL": "postgresql+psycopg://nobody@127.0.0.1:1/x",
            "KVGRAFT_BLOB_URL": (tmp_path / "no-such-store").as_uri()}
    out = tmp_path / "o.kv"
    args = ["pull", "t/a:v1", "-o", str(out), "--json"]
    if form == "subcommand":
        args.append("--offline")
    elif form == "global":
        args.insert(0, "--offline")
    r = CliRunner(env={**gone, "KVGRAFT_OFFLINE": "1"} if form == "env" else gone).invoke(
        cli, args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["fetched"] == 0
    assert out.read_bytes() == src.read_bytes()
    r = CliRunner(env=gone).invoke(cli, ["pull", "t/a:v1"])  # online: the catalog is gone
    assert r.exit_code == 7, r.output


def test_a_cache_that_keeps_blobs_decoded_still_verifies_every_read(
        make_registry: RegistryFactory, tmp_path: Path) -> None:
    from kvgraft.codecs.codec import frame_header
    from kvgraft.formats.manifest import BlobRef
    from kvgraft.transfer.pull import Fetcher

    reg = make_registry()
    digest = reg.push(write_synthetic(tmp_path / "a.kv", tokens=600), "t/a").digest
    chunk = reg.manifest(digest).chunks[0]
    ref = BlobRef(chunk.digest, chunk.size)
    raw_header = frame_header("raw", ref.size)
    cache = make_registry(cache_dir=tmp_path / "c2").cache
    plain = Fetcher(reg.store, cache)
    data, fetched = plain.get(ref)
    assert fetched > 0
    path = cache.blobs._path(ref.digest)
    assert not path.read_bytes().startswith(raw_header)  # as the store holds it
    hot = Fetcher(None, cache, keep_decoded=True)  # offline: only the cache may answer
    buf = bytearray(ref.size)
    assert bytes(hot.get(ref, buf)[0]) == bytes(data)
    assert path.read_bytes().startswith(raw_header)  # now decoded
    assert bytes(hot.get(ref, bytearray(ref.size))[0]) == bytes(data)  # straight read
    # a flipped byte, a truncated entry, a grown entry: each dropped, never returned
    good = path.read_bytes()
    for bad in (good[:-1] + bytes([good[-1] ^ 1]), good[:-7], good + b"x"):
        path.write_bytes(bad)
        assert cache.get(ref.digest, ref.size, bytearray(ref.size)) is None
        assert not path.exists()
    # fetched from the store again, straight into the decoded form
    data2, fetched = Fetcher(reg.store, cache, keep_decoded=True).get(ref)
    assert fetched > 0 and bytes(data2) == bytes(data)
    assert path.read_bytes() == good

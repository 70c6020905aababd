"""Garbage collection: plan then execute, on every store and both catalogs, and safe while
other writers push artifacts that share blobs with the ones being deleted."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvgraft.blobstore.base import blob_path
from kvgraft.blobstore.local import LocalBlobStore
from kvgraft.catalog import Catalog, PushRecord
from kvgraft.catalog.records import PushOutcome
from kvgraft.cli.main import cli
from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError
from kvgraft.services.backends import Direct
from kvgraft.transfer.gc import GcResult
from kvgraft.transfer.push import PushOptions, build_artifact
from tests.support.harness import RegistryFactory, sql_catalog
from tests.support.synthetic import stored, variant
from tests.support.tampering import tamper


@pytest.fixture
def reg(make_registry: RegistryFactory, catalog_url: str,
        store_url: str) -> Iterator[Registry]:
    Catalog.open(catalog_url, auto_upgrade=True).close()
    r = make_registry(catalog_url=catalog_url, blob_url=store_url)
    yield r
    r.close()


def intact(r: Registry, ref: str) -> bool:
    return all(report.ok for report in r.verify(ref))


def test_plan_then_execute(reg: Registry, tmp_path: Path) -> None:
    a = reg.push(variant(tmp_path / "a.kv", 1), "gc/a:v1").digest
    b = reg.push(variant(tmp_path / "b.kv", 2), "gc/b:v1").digest  # shares a's chunks
    c = reg.push(variant(tmp_path / "c.kv", 3, seed=5), "gc/c:v1").digest
    reg.untag("gc/a:v1")
    reg.untag("gc/c:v1")
    # A push that died before its commit leaves blobs no artifact references.
    orphan = build_artifact(variant(tmp_path / "o.kv", 4, seed=9), reg.store, PushOptions())
    keep = {x.digest for x in reg.manifest(b).blobs()}
    doomed = stored(reg) - keep
    assert {x.digest for x in orphan.blobs} <= doomed
    assert reg.manifest(a).header.digest in doomed

    plan = reg.gc_plan(grace=0, untagged_older_than=0)
    assert set(plan.artifacts) == {a, c}
    assert {x.digest for x in plan.blobs} == doomed
    assert plan.bytes_freed == sum(x.stored_size for x in reg.store.iter() if x.digest in doomed)
    assert (plan.kept_artifacts, plan.kept_blobs) == (1, len(keep))
    assert stored(reg) == keep | doomed  # planning deletes nothing

    result = reg.gc(plan)
    assert set(result.artifacts) == {a, c} and set(result.blobs) == doomed
    assert result.bytes_freed == plan.bytes_freed and not result.errors
    assert stored(reg) == keep
    assert set(reg.catalog.artifact_digests()) == {b}
    assert intact(reg, "gc/b:v1")
    [event] = reg.log(action="gc")
    assert sorted(event.detail["artifacts_deleted"]) == sorted(str(d) for d in (a, c))
    assert event.detail["blobs_planned"] == len(doomed)
    assert reg.gc_plan(grace=0, untagged_older_than=0).blobs == ()
    # The history of a collected artifact outlives it.
    assert [e.action for e in reg.log(f"gc/a@{a}")] == ["push", "untag"]


def test_grace_retention_and_lineage_keep_things(make_registry: RegistryFactory,
                                                 catalog_url: str, tmp_path: Path) -> None:
    Catalog.open(catalog_url, auto_upgrade=True).close()
    reg = make_registry(catalog_url=catalog_url)
    parent = reg.push(variant(tmp_path / "p.kv", 1, seed=1), "lin/p:v1").digest
    child = reg.push(variant(tmp_path / "c.kv", 2, seed=2), "lin/c:v1",
                     options=PushOptions(parents=(parent,))).digest
    loose = reg.push(variant(tmp_path / "l.kv", 3, seed=3), "lin/l:v1").digest
    for ref in ("lin/p:v1", "lin/l:v1"):
        reg.untag(ref)
    build_artifact(variant(tmp_path / "o.kv", 4, seed=4), reg.store, PushOptions())
    assert reg.gc_plan(grace=0).artifacts == ()  # no retention given: every artifact stays
    young = reg.gc_plan(grace=3600, untagged_older_than=3600)
    assert young.artifacts == () and young.blobs == () and young.young_blobs == 5
    plan = reg.gc_plan(grace=0, untagged_older_than=0)
    assert plan.artifacts == (loose,)  # the untagged parent of a tagged child stays
    reg.gc(plan)
    assert intact(reg, f"lin/p@{parent}") and intact(reg, "lin/c:v1")
    assert reg.audit("lin/c:v1").ok
    reg.untag("lin/c:v1")
    assert set(reg.gc_plan(grace=0, untagged_older_than=0).artifacts) == {parent, child}
    reg.close()


def _corrupt_manifest(r: Registry, digest: Digest, how: str) -> None:
    raw = r.catalog.artifact(digest).manifest.decode()
    if how == "parents-dropped":  # still a valid manifest, but not the one the digest names
        bad = raw.replace(raw[raw.index('"parents":'):raw.index("]", raw.index('"parents":'))
                              + 1], '"parents":[]')
    else:
        bad = raw[:len(raw) // 2]
    assert bad != raw
    tamper(sql_catalog(r), "UPDATE artifacts SET manifest = :m WHERE digest = :d", m=bad,
           d=str(digest))


@pytest.mark.parametrize("store_url", ["local"], indirect=True)
@pytest.mark.parametrize("how", ["parents-dropped", "truncated"])
def test_gc_refuses_when_a_kept_manifest_is_corrupt(reg: Registry, tmp_path: Path,
                                                    how: str) -> None:
    parent = reg.push(variant(tmp_path / "p.kv", 1, seed=1), "fc/p:v1").digest
    child = reg.push(variant(tmp_path / "c.kv", 2, seed=2), "fc/c:v1",
                     options=PushOptions(parents=(parent,))).digest
    loose = reg.push(variant(tmp_path / "l.kv", 3, seed=3), "fc/l:v1").digest
    reg.untag("fc/p:v1")
    reg.untag("fc/l:v1")
    _corrupt_manifest(reg, child, how)
    blobs_before = stored(reg)
    # The tagged child's parents can no longer be read, so its untagged parent would look
    # collectable: gc must refuse rather than guess, and name the artifact.
    with pytest.raises(IntegrityError, match=f"artifact {child}") as err:
        reg.gc_plan(grace=0, untagged_older_than=0)
    assert "nothing deleted" in str(err.value)
    assert set(reg.catalog.artifact_digests()) == {parent, child, loose}
    assert stored(reg) == blobs_before
    # Without a retention no artifact is deleted: that plan is safe and still runs, and it
    # keeps every blob of the corrupt artifact (the catalog's blob links say which).
    result = reg.gc(reg.gc_plan(grace=0))
    assert result.artifacts == () and result.blobs == ()
    assert stored(reg) == blobs_before


def _undeletable(r: Registry, digest: Digest) -> Path:
    """Put a directory where the blob's file is: the store can neither read nor unlink it
    (permission tricks do not work as root)."""
    assert isinstance(r.store, LocalBlobStore)
    path = r.store.root / blob_path(digest)
    path.unlink()
    path.mkdir()
    return path


@pytest.mark.parametrize("store_url", ["local"], indirect=True)
def test_a_blob_the_store_cannot_delete_does_not_stop_the_sweep(reg: Registry,
                                                                tmp_path: Path) -> None:
    a = reg.push(variant(tmp_path / "a.kv", 1, seed=1), "bad/a:v1").digest
    reg.untag("bad/a:v1")
    doomed = sorted(stored(reg))
    first = doomed[0]  # swept first: it used to abort the sweep there
    path = _undeletable(reg, first)
    plan = reg.gc_plan(grace=0, untagged_older_than=0)
    assert {b.digest for b in plan.blobs} == set(doomed)
    result = reg.gc(plan)
    assert result.artifacts == (a,)
    assert set(result.blobs) == set(doomed[1:])
    assert stored(reg) == {first}
    [error] = result.errors
    assert str(first) in error and f"cannot delete blob {path}" in error


def _gc_during_commit(monkeypatch: pytest.MonkeyPatch, r: Registry) -> list[GcResult]:
    """Run a whole gc after the next push stored its blobs and before it commits: the
    worst moment, made certain instead of left to chance."""
    ran: list[GcResult] = []
    real = Catalog.record_push

    def late(self: Catalog, push: PushRecord) -> PushOutcome:
        if not ran:
            ran.append(r.gc(r.gc_plan(grace=0, untagged_older_than=0)))
        return real(self, push)

    monkeypatch.setattr(Catalog, "record_push", late)
    return ran


@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_gc_between_a_push_and_its_commit(reg: Registry, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    old = reg.push(variant(tmp_path / "old.kv", 1), "race/old:v1").digest
    reg.untag("race/old:v1")
    ran = _gc_during_commit(monkeypatch, reg)
    new = reg.push(variant(tmp_path / "new.kv", 2), "race/new:v1")
    [result] = ran
    shared = {c.digest for c in reg.manifest(old).chunks}
    assert result.artifacts == (old,) and shared <= set(result.blobs)  # gc really hit it
    assert new.blobs_stored == 1  # the push itself found the shared blobs present
    assert intact(reg, "race/new:v1")
    out = tmp_path / "out.kv"
    reg.pull("race/new:v1", out)
    assert out.read_bytes() == (tmp_path / "new.kv").read_bytes()


@pytest.mark.parametrize("store_url", ["memory"], indirect=True)
def test_without_the_post_commit_check_that_race_loses_data(
        reg: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control for the test above: the race is real, and the re-check is what wins it."""
    reg.push(variant(tmp_path / "old.kv", 1), "race/old:v1")
    reg.untag("race/old:v1")
    _gc_during_commit(monkeypatch, reg)
    monkeypatch.setattr(Direct, "ensure_blobs", lambda *a: None)
    reg.push(variant(tmp_path / "new.kv", 2), "race/new:v1")
    assert not intact(reg, "race/new:v1")


@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_gc_racing_pushes(make_registry: RegistryFactory, catalog_url: str, store_url: str,
                          tmp_path: Path) -> None:
    Catalog.open(catalog_url, auto_upgrade=True).close()
    seeds = range(3)
    setup = make_registry(catalog_url=catalog_url, blob_url=store_url)
    for s in seeds:  # artifacts about to be collected, sharing blobs with what comes next
        setup.push(variant(tmp_path / f"old{s}.kv", 0, seed=s, tokens=520), f"r/old{s}:v1")
        setup.untag(f"r/old{s}:v1")
    setup.close()
    done = threading.Event()
    errors: list[BaseException] = []
    pushed: list[tuple[str, Path]] = []
    runs: list[GcResult] = []

    def pusher(s: int) -> None:
        r = make_registry(catalog_url=catalog_url, blob_url=store_url,
                          cache_dir=tmp_path / f"cache{s}")
        try:
            for run in range(1, 4):
                src = variant(tmp_path / f"new{s}-{run}.kv", run, seed=s, tokens=520)
                r.push(src, f"r/new{s}:v{run}")
                pushed.append((f"r/new{s}:v{run}", src))
                if run > 1:  # churn: the previous one becomes garbage at once
                    r.untag(f"r/new{s}:v{run - 1}")
        except BaseException as e:  # collected: a thread's failure must fail the test
            errors.append(e)
        finally:
            r.close()

    def collector() -> None:
        r = make_registry(catalog_url=catalog_url, blob_url=store_url,
                          cache_dir=tmp_path / "gc-cache")
        try:
            # At least two passes whatever the timing: the assertions below count on them.
            while not done.is_set() or len(runs) < 2:
                # The catalog starts empty while the pushers' blobs land: say so.
                runs.append(r.gc(r.gc_plan(grace=0, untagged_older_than=0),
                                 allow_empty_catalog=True))
        except BaseException as e:
            errors.append(e)
        finally:
            r.close()

    gc_thread = threading.Thread(target=collector)
    gc_thread.start()
    threads = [threading.Thread(target=pusher, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    gc_thread.join()
    assert not errors, errors
    assert sum(len(x.artifacts) for x in runs) >= 1 and len(runs) >= 2
    check = make_registry(catalog_url=catalog_url, blob_url=store_url,
                          cache_dir=tmp_path / "check-cache")
    # Every artifact that is still tagged pulls and verifies, byte for byte.
    tagged = {f"{t.repository}:{t.tag}" for t in check.list()}
    assert tagged == {f"r/new{s}:v3" for s in seeds}
    for ref, src in pushed:
        if ref in tagged:
            assert intact(check, ref), ref
            out = tmp_path / "out.kv"
            check.pull(ref, out)
            assert out.read_bytes() == src.read_bytes()
    check.close()


def test_gc_command(cli_env: dict[str, str], tmp_path: Path) -> None:
    runner = CliRunner(env=cli_env)

    def run(*args: str) -> Any:
        return runner.invoke(cli, list(args))

    assert run("push", str(variant(tmp_path / "a.kv", 1)), "cmd/a:v1").exit_code == 0
    assert run("push", str(variant(tmp_path / "b.kv", 2, seed=3)), "cmd/b:v1").exit_code == 0
    assert run("untag", "cmd/b:v1").exit_code == 0
    r = run("gc", "--dry-run", "--grace", "0s", "--untagged-older-than", "0s", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["dry_run"] and len(plan["plan"]["artifacts"]) == 1
    assert plan["plan"]["bytes_freed"] > 0
    r = run("gc", "--dry-run", "--grace", "0s", "--untagged-older-than", "0s")
    assert r.exit_code == 0 and "would delete 1 artifact(s)" in r.stderr
    r = run("gc", "--untagged-older-than", "7d")  # b is younger than a week: nothing to do
    assert r.exit_code == 0 and "deleted 0 artifact(s), 0 blob(s)" in r.stderr
    r = run("gc", "--grace", "0s", "--untagged-older-than", "0s", "--json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["blobs_deleted"] == len(plan["plan"]["blobs"])
    assert run("pull", "cmd/a:v1").exit_code == 0
    for bad in ("soon", "-1s", "1y"):
        assert run("gc", "--grace", bad).exit_code == 2
    assert len(json.loads(run("log", "--action", "gc", "--json").stdout.splitlines()[-1])
               ["detail"]["artifacts_deleted"]) == 1


def test_gc_command_reports_a_blob_it_cannot_delete(cli_env: dict[str, str], tmp_path: Path,
                                                    make_registry: RegistryFactory) -> None:
    runner = CliRunner(env=cli_env)
    assert runner.invoke(cli, ["push", str(variant(tmp_path / "a.kv", 1)), "cmd/a:v1"]
                         ).exit_code == 0
    assert runner.invoke(cli, ["untag", "cmd/a:v1"]).exit_code == 0
    reg = make_registry(home=Path(cli_env["KVGRAFT_HOME"]))
    doomed = sorted(stored(reg))
    path = _undeletable(reg, doomed[0])
    r = runner.invoke(cli, ["gc", "--grace", "0s", "--untagged-older-than", "0s"])
    assert r.exit_code == 7, r.output
    assert f"deleted 1 artifact(s), {len(doomed) - 1} blob(s)" in r.stderr
    assert str(path) in r.stderr
    assert stored(reg) == {doomed[0]}
    reg.close()


def test_gc_command_refuses_on_a_corrupt_manifest(cli_env: dict[str, str], tmp_path: Path,
                                                  make_registry: RegistryFactory) -> None:
    runner = CliRunner(env=cli_env)
    parent = runner.invoke(cli, ["push", str(variant(tmp_path / "p.kv", 1, seed=1)),
                                 "cmd/p:v1"]).stdout.strip()
    r = runner.invoke(cli, ["push", str(variant(tmp_path / "c.kv", 2, seed=2)), "cmd/c:v1",
                            "--parent", "cmd/p:v1"])
    assert r.exit_code == 0, r.output
    child = Digest.parse(r.stdout.strip())
    assert runner.invoke(cli, ["untag", "cmd/p:v1"]).exit_code == 0
    reg = make_registry(home=Path(cli_env["KVGRAFT_HOME"]))
    _corrupt_manifest(reg, child, "parents-dropped")
    for extra in (["--dry-run"], [], ["--json"]):
        r = runner.invoke(cli, ["gc", "--grace", "0s", "--untagged-older-than", "0s", *extra])
        assert r.exit_code == 4, r.output
        assert str(child) in r.stderr and "nothing deleted" in r.stderr
    assert reg.catalog.artifact_digests() == [Digest.parse(parent), child]
    reg.close()

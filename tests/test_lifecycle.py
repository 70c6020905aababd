"""Lifecycle: last use recorded with each use, `gc --unused-for` (pins exempt, tags do not),
repository byte quotas that evict the least recently used unpinned grafts or refuse the
push, on SQLite and PostgreSQL; gc racing a restore of the graft it is about to collect."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner
from sqlalchemy import update

from kvgraft.blobstore.local import LocalBlobStore
from kvgraft.catalog import Catalog
from kvgraft.catalog.models import ArtifactRow
from kvgraft.cli.main import cli
from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, NotFound, QuotaExceeded
from tests.support.harness import RegistryFactory, sql_catalog
from tests.support.serve import kvgraft, make_token, running_server, server_env
from tests.support.synthetic import stored, variant

DAY = 86400.0


@pytest.fixture
def reg(make_registry: RegistryFactory, catalog_url: str, tmp_path: Path) -> Iterator[Registry]:
    Catalog.open(catalog_url, auto_upgrade=True).close()
    r = make_registry(catalog_url=catalog_url, blob_url=(tmp_path / "blobs").as_uri())
    yield r
    r.close()


def age(r: Registry, digest: Digest, *, created: float, used: float | None) -> None:
    """Move an artifact's push (and last use) `created` (`used`) days into the past."""
    now = datetime.now(UTC)
    with sql_catalog(r)._session(write=True) as s:
        s.execute(update(ArtifactRow).where(ArtifactRow.digest == str(digest)).values(
            created_at=now - timedelta(days=created),
            last_used_at=None if used is None else now - timedelta(days=used)))


def test_uses_are_recorded_once_a_minute(reg: Registry, tmp_path: Path) -> None:
    d = reg.push(variant(tmp_path / "a.kv", 1), "lc/a:v1").digest
    assert reg.inspect("lc/a:v1").record.last_used is None  # never since pushed
    reg.pull("lc/a:v1", tmp_path / "out.kv")
    first = reg.inspect("lc/a:v1").record.last_used
    assert first is not None and datetime.now(UTC) - first < timedelta(minutes=1)
    reg.pull("lc/a:v1", tmp_path / "out2.kv")  # within the minute: nothing written
    assert reg.inspect("lc/a:v1").record.last_used == first
    reg.events.record("pull", repository="lc/a", digest=d, outcome="failed")
    reg.events.record("verify", repository="lc/a", digest=d)  # not a use
    age(reg, d, created=3, used=2)
    reg.events.record("verify", repository="lc/a", digest=d)
    assert datetime.now(UTC) - used(reg, "lc/a:v1") > timedelta(days=1)
    reg.events.record("match", repository="lc/a", digest=d)
    assert datetime.now(UTC) - used(reg, "lc/a:v1") < timedelta(minutes=1)


def used(r: Registry, ref: str) -> datetime:
    last = r.inspect(ref).record.last_used
    assert last is not None
    return last


def test_gc_unused_for_takes_tagged_grafts_nobody_uses_and_spares_pins(
        reg: Registry, tmp_path: Path) -> None:
    a = reg.push(variant(tmp_path / "a.kv", 1), "lc/a:v1").digest
    b = reg.push(variant(tmp_path / "b.kv", 2), "lc/b:v1").digest  # shares a's chunks
    c = reg.push(variant(tmp_path / "c.kv", 3, seed=4), "lc/c:v1").digest
    d = reg.push(variant(tmp_path / "d.kv", 4, seed=6), "lc/d:v1").digest
    reg.tag("lc/a:v1", "lc/a:also")
    age(reg, a, created=40, used=None)  # never used since its push, 40 days ago
    age(reg, b, created=40, used=31)
    age(reg, c, created=40, used=35)
    age(reg, d, created=40, used=2)
    assert reg.pin("lc/c:v1") == c
    assert reg.inspect("lc/c:v1").record.pinned == ("lc/c",)
    plan = reg.gc_plan(grace=0, unused_for=30 * DAY)
    assert set(plan.artifacts) == {a, b}
    # a chunk b shares with a stays while ... nothing else holds it: all of a and b go
    keep = {x.digest for r in (c, d) for x in reg.manifest(r).blobs()}
    result = reg.gc(plan)
    assert set(result.artifacts) == {a, b}
    assert stored(reg) == keep
    for ref in ("lc/a:v1", "lc/a:also", "lc/b:v1"):
        with pytest.raises(NotFound):
            reg.resolve(ref)
    assert all(report.ok for ref in ("lc/c:v1", "lc/d:v1") for report in reg.verify(ref))
    log = [e for e in reg.log(action="gc") if e.detail.get("unused_for_seconds")]
    assert log and set(log[-1].detail["artifacts_deleted"]) == {str(a), str(b)}
    reg.unpin("lc/c:v1")
    assert reg.inspect("lc/c:v1").record.pinned == ()
    assert reg.gc_plan(grace=0, unused_for=30 * DAY).artifacts == (c,)


def test_unused_for_keeps_the_chunks_a_used_graft_shares(reg: Registry, tmp_path: Path) -> None:
    a = reg.push(variant(tmp_path / "a.kv", 1), "lc/a:v1").digest
    b = reg.push(variant(tmp_path / "b.kv", 2), "lc/b:v1").digest  # shares a's chunks
    age(reg, a, created=40, used=None)
    result = reg.gc(reg.gc_plan(grace=0, unused_for=30 * DAY))
    assert result.artifacts == (a,)
    assert {x.digest for x in reg.manifest(b).blobs()} <= stored(reg)
    assert all(report.ok for report in reg.verify("lc/b:v1"))


def test_a_use_between_plan_and_execute_saves_the_graft(reg: Registry, tmp_path: Path) -> None:
    a = reg.push(variant(tmp_path / "a.kv", 1), "lc/a:v1").digest
    age(reg, a, created=40, used=40)
    plan = reg.gc_plan(grace=0, unused_for=30 * DAY)
    assert plan.artifacts == (a,)
    reg.pull("lc/a:v1", tmp_path / "out.kv")  # an engine restores it meanwhile
    result = reg.gc(plan)
    assert result.artifacts == () and result.blobs == ()
    assert all(report.ok for report in reg.verify("lc/a:v1"))


def test_gc_collecting_a_graft_mid_restore_fails_the_restore_cleanly(
        reg: Registry, make_registry: RegistryFactory, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a = reg.push(variant(tmp_path / "a.kv", 1), "lc/a:v1").digest
    age(reg, a, created=40, used=40)
    # another machine, whose cache has none of it: every blob comes from the store
    node = make_registry(home=tmp_path / "node", catalog_url=reg.config.catalog_url,
                         blob_url=reg.config.blob_url)
    real = LocalBlobStore.get
    collected: list[object] = []

    def get(self: LocalBlobStore, digest: Digest, limit: int | None = None) -> bytes:
        if not collected:  # the restore read its first blob: gc runs now, to the end
            collected.append(reg.gc(reg.gc_plan(grace=0, unused_for=30 * DAY)))
        return real(self, digest, limit)

    monkeypatch.setattr(LocalBlobStore, "get", get)
    out = tmp_path / "restored.kv"
    with pytest.raises((IntegrityError, NotFound)):
        node.pull("lc/a:v1", out)
    node.close()
    assert collected and not out.exists()  # no partial file, no wrong bytes
    with pytest.raises(NotFound):
        reg.resolve("lc/a:v1")


def _held(r: Registry, repository: str) -> int:
    [q] = [q for q in r.quotas() if q.repository == repository]
    return q.held_bytes


def test_quota_evicts_the_least_recently_used_unpinned_or_refuses(
        reg: Registry, tmp_path: Path) -> None:
    a = reg.push(variant(tmp_path / "a.kv", 1, seed=1), "q/vllm:a").digest
    b = reg.push(variant(tmp_path / "b.kv", 2, seed=2), "q/vllm:b").digest
    reg.push(variant(tmp_path / "a.kv", 1, seed=1), "q/other:a")  # the same bytes elsewhere
    assert reg.set_quota("q/vllm", 10**12) is None
    two = _held(reg, "q/vllm")
    assert reg.set_quota("q/vllm", two * 5 // 4) == 10**12
    reg.pull("q/vllm:a", tmp_path / "used.kv")  # a is used after b was pushed
    c = reg.push(variant(tmp_path / "c.kv", 3, seed=3), "q/vllm:c")
    assert c.evicted == (b,)
    assert _held(reg, "q/vllm") <= two * 5 // 4
    assert [t.tag for t in reg.list("q/vllm")] == ["a", "c"]
    with pytest.raises(NotFound):
        reg.resolve(f"q/vllm@{b}")
    assert reg.resolve("q/other:a") == a  # another repository's copy is its own
    [evict] = reg.log(action="evict")
    assert evict.repository == "q/vllm" and evict.detail["artifacts"] == [str(b)]
    # b is gone from the repository; its bytes leave the store at the next gc
    gone = reg.gc(reg.gc_plan(grace=0, untagged_older_than=0))
    assert gone.artifacts == (b,)
    reg.pin("q/vllm:a")
    reg.pin("q/vllm:c")
    with pytest.raises(QuotaExceeded, match="does not fit"):
        reg.push(variant(tmp_path / "d.kv", 4, seed=4), "q/vllm:d")
    assert [t.tag for t in reg.list("q/vllm")] == ["a", "c"]
    assert [e.outcome for e in reg.log(action="push") if e.tag == "d"] == ["refused"]
    reg.push(variant(tmp_path / "e.kv", 5, seed=5), "q/free:e")
    with pytest.raises(QuotaExceeded):  # a tag into the repository is held to it too
        reg.tag("q/free:e", "q/vllm:e")
    assert [t.tag for t in reg.list("q/vllm")] == ["a", "c"]
    reg.set_quota("q/vllm", None)
    assert reg.quotas() == ()
    reg.push(variant(tmp_path / "d.kv", 4, seed=4), "q/vllm:d")


def test_cli_pin_quota_and_gc_unused_for(reg: Registry, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in (("KVGRAFT_HOME", str(reg.config.home)),
                       ("KVGRAFT_CATALOG_URL", reg.config.catalog_url),
                       ("KVGRAFT_BLOB_URL", reg.config.blob_url)):
        monkeypatch.setenv(key, value)
    a = reg.push(variant(tmp_path / "a.kv", 1), "cli/a:v1").digest
    age(reg, a, created=40, used=None)
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> str:
        done = runner.invoke(cli, list(args))
        assert done.exit_code == code, (args, done.output)
        return done.output

    assert str(a) in run("pin", "cli/a:v1")
    plan = json.loads(run("gc", "--unused-for", "30d", "--grace", "0s", "--dry-run", "--json"))
    assert plan["plan"]["artifacts"] == [] and plan["plan"]["unused_for_seconds"] == 30 * DAY
    run("unpin", "cli/a:v1")
    plan = json.loads(run("gc", "--unused-for", "30d", "--grace", "0s", "--dry-run", "--json"))
    assert plan["plan"]["artifacts"] == [str(a)]
    run("quota", "set", "cli/a", "200GiB")
    [q] = json.loads(run("quota", "ls", "--json"))["quotas"]
    assert q["max_bytes"] == 200 * 2**30 and q["held_bytes"] > 0
    assert "cli/a" in run("quota", "ls", "cli/*")
    run("quota", "rm", "cli/a")
    assert "no quotas" in run("quota", "ls")
    run("quota", "set", "cli/a", "lots", code=2)
    run("quota", "set", "Not A Name", "1GiB", code=2)
    run("quota", "set", "cli/a", "99999999999PiB", code=2)
    run("pin", "cli/none:v1", code=3)
    run("gc", "--unused-for", "forever", code=2)
    run("gc", "--unused-for", "30d", "--grace", "0s")
    run("pin", "cli/a:v1", code=3)


def test_pins_and_quotas_through_a_server(tmp_path: Path) -> None:
    """Pinning needs admin over the repository, quotas admin over all; a push through the
    server past a quota is refused with its own exit code and message; last use is shown
    to admins only (another tenant's use of the same bytes is not a tenant's to see)."""
    env = server_env(tmp_path / "server")
    tokens = {"rw": make_token(env, "rw", "repository:team/*:pull,push,delete"),
              "team-admin": make_token(env, "team-admin", "repository:team/*:*"),
              "admin": make_token(env, "admin", "repository:*:*")}
    node = server_env(tmp_path / "node")
    with running_server(env, tmp_path / "server.log") as server:
        for name, token in tokens.items():
            (tmp_path / f"{name}.token").write_text(token + "\n")
            kvgraft(node, "remote", "add", name, server.url, "--token-file",
                    str(tmp_path / f"{name}.token"))

        def run(remote: str, *args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "kvgraft.cli", "--remote", remote,
                                   *args], env=node, capture_output=True, text=True)

        one = variant(tmp_path / "one.kv", 1, seed=1)
        assert run("rw", "push", str(one), "team/a:v1").returncode == 0
        assert run("rw", "pull", "team/a:v1", "-o", str(tmp_path / "o.kv")).returncode == 0
        refused = run("rw", "pin", "team/a:v1")
        assert refused.returncode == 8, refused.stderr
        assert run("team-admin", "pin", "team/a:v1").returncode == 0
        shown = json.loads(run("admin", "inspect", "team/a:v1", "--json").stdout)
        assert shown["pinned"] == ["team/a"] and shown["last_used"] is not None
        assert json.loads(run("rw", "inspect", "team/a:v1", "--json").stdout)[
            "last_used"] is None
        assert run("team-admin", "quota", "set", "team/a", "1KiB").returncode == 8
        assert run("admin", "quota", "set", "team/a", "1KiB").returncode == 0
        assert run("rw", "quota", "ls").returncode == 8
        [q] = json.loads(run("admin", "quota", "ls", "--json").stdout)["quotas"]
        assert q == {"repository": "team/a", "max_bytes": 1024, "held_bytes": q["held_bytes"]}
        over = run("rw", "push", str(variant(tmp_path / "two.kv", 2, seed=2)), "team/a:v2")
        assert over.returncode == 6 and "does not fit" in over.stderr, over.stderr
        assert "team/a:v2" not in run("rw", "ls").stdout
        forged = requests.post(f"{server.url}/kvgraft/v1/events", json={
            "action": "quota", "repository": "team/a"},
            headers={"Authorization": f"Bearer {tokens['rw']}"}, timeout=30)
        assert forged.status_code == 400  # lifecycle events are the server's to write
        bad = requests.post(f"{server.url}/kvgraft/v1/quotas", json={
            "repository": "team/a", "max_bytes": -1},
            headers={"Authorization": f"Bearer {tokens['admin']}"}, timeout=30)
        assert bad.status_code == 400
        assert run("admin", "quota", "rm", "team/a").returncode == 0
        assert run("rw", "push", str(tmp_path / "two.kv"), "team/a:v2").returncode == 0
        # gc --unused-for through the server: admins only; the pinned graft stays
        assert run("team-admin", "gc", "--unused-for", "0s", "--dry-run").returncode == 8
        two = json.loads(run("rw", "inspect", "team/a:v2", "--json").stdout)["digest"]
        planned = run("admin", "gc", "--unused-for", "0s", "--grace", "0s", "--dry-run",
                      "--json")
        assert json.loads(planned.stdout)["plan"]["artifacts"] == [two], planned.stderr
        done = run("admin", "gc", "--unused-for", "0s", "--grace", "0s", "--json")
        result = json.loads(done.stdout)
        assert result["artifacts_deleted"] == [two] and result["blobs_deleted"] > 0
        assert run("rw", "pull", "team/a:v2", "-o", str(tmp_path / "x.kv")).returncode == 3
        assert run("rw", "pull", "team/a:v1", "-o", str(tmp_path / "y.kv")).returncode == 0
        [event] = [e for e in map(json.loads, run("admin", "log", "--action", "gc", "--json")
                                  .stdout.splitlines())]
        assert event["actor"] == "token:admin"
        assert server.alive()
    assert "Traceback" not in (tmp_path / "server.log").read_text()

"""The append-only, hash-chained event log, on SQLite and PostgreSQL."""

from __future__ import annotations

import importlib.util
import json
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError

from kvgraft.catalog import Catalog, EventRecord
from kvgraft.catalog.engine import make_engine
from kvgraft.catalog.events import GENESIS, event_hash
from kvgraft.catalog.models import EventRow
from kvgraft.catalog.schema import upgrade
from kvgraft.cli.main import cli
from kvgraft.client import Registry
from kvgraft.resources import migrations_dir
from tests.support.harness import RegistryFactory, sql_catalog
from tests.support.synthetic import write_synthetic
from tests.support.tampering import tamper


def _event(action: str, **kw: Any) -> EventRecord:
    return EventRecord(action=action, actor="me@here", host="here", **kw)


def test_every_change_writes_one_event(make_registry: RegistryFactory, catalog_url: str,
                                       tmp_path: Path) -> None:
    Catalog.open(catalog_url, auto_upgrade=True).close()
    reg = make_registry(catalog_url=catalog_url)
    other = make_registry(home=tmp_path / "other")
    src = write_synthetic(tmp_path / "a.kv", tokens=300)
    digest = reg.push(src, "ev/a:v1").digest
    reg.pull("ev/a:v1")
    reg.tag("ev/a:v1", "ev/a:stable")
    reg.untag("ev/a:v1")
    reg.verify("ev/a:stable")
    reg.copy("ev/a:stable", other, "ev/copy:v1")
    reg.keyring.generate("me")
    reg.sign("ev/a:stable", "me")
    reg.gc(reg.gc_plan(grace=3600))
    events = reg.log()
    assert [e.action for e in events] == ["push", "pull", "tag", "untag", "verify", "copy",
                                          "sign", "gc"]
    assert all(e.actor == f"{reg.user}@{reg.host}" and e.outcome == "ok" for e in events)
    assert all(e.digest == digest for e in events[:-1])
    assert [e.action for e in other.log()] == ["copy"]
    assert [e.action for e in reg.log("ev/a:stable")] == [e.action for e in events[:-1]]
    chain = reg.catalog.event_chain()
    assert chain.ok and chain.events == 8 and chain.head is not None and chain.head[0] == 8
    reg.close()
    other.close()


def test_the_database_refuses_to_rewrite_events(catalog_url: str) -> None:
    catalog = Catalog.open(catalog_url, auto_upgrade=True)
    catalog.add_event(_event("push"))
    for sql in ("UPDATE events SET outcome = 'failed'", "DELETE FROM events"):
        with pytest.raises(DBAPIError, match="append-only"), catalog.engine.begin() as conn:
            conn.execute(text(sql))
    assert [e.outcome for e in catalog.events()] == ["ok"]
    catalog.close()


def test_deleted_and_edited_rows_break_the_chain(catalog_url: str) -> None:
    catalog = Catalog.open(catalog_url, auto_upgrade=True)
    for i in range(6):
        catalog.add_event(_event("pull", detail={"i": i}))
    assert catalog.event_chain().ok
    tamper(catalog, "DELETE FROM events WHERE seq = 3")
    report = catalog.event_chain()
    assert [(p.seq, p.kind) for p in report.problems] == [(3, "missing")]
    assert "event 3 missing" in report.problems[0].message
    tamper(catalog, "UPDATE events SET detail = :d WHERE seq = 5", d='{"i":40}')
    assert [(p.seq, p.kind) for p in catalog.event_chain().problems] == [
        (3, "missing"), (5, "edited")]
    tamper(catalog, "DELETE FROM events WHERE seq = 1")
    assert catalog.event_chain().problems[0].message.startswith("event 1 missing")
    catalog.close()


def test_an_edit_that_rehashes_its_row_still_breaks_the_next_link(catalog_url: str) -> None:
    catalog = Catalog.open(catalog_url, auto_upgrade=True)
    for i in range(3):
        catalog.add_event(_event("pull", detail={"i": i}))
    with catalog.engine.connect() as conn:
        row = conn.execute(select(EventRow).where(EventRow.seq == 2)).mappings().one()
    forged = {**row, "outcome": "failed"}  # a forger who knows the hash recipe
    new_hash = event_hash(2, row["prev_hash"], row["at"], forged)
    tamper(catalog, "UPDATE events SET outcome = 'failed', hash = :h WHERE seq = 2", h=new_hash)
    assert [(p.seq, p.kind) for p in catalog.event_chain().problems] == [(3, "broken-link")]
    catalog.close()


def test_concurrent_writers_keep_one_chain(catalog_url: str) -> None:
    Catalog.open(catalog_url, auto_upgrade=True).close()
    errors: list[BaseException] = []

    def write(n: int) -> None:
        catalog = Catalog.open(catalog_url)
        try:
            for i in range(15):
                catalog.add_event(_event("pull", detail={"writer": n, "i": i}))
        except BaseException as e:  # collected: a thread's failure must fail the test
            errors.append(e)
        finally:
            catalog.close()

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    catalog = Catalog.open(catalog_url)
    report = catalog.event_chain()
    assert report.ok and report.events == 60 and report.head is not None
    assert report.head[0] == 60
    catalog.close()


def test_upgrade_chains_events_written_before_the_chain(catalog_url: str) -> None:
    engine = make_engine(catalog_url)
    upgrade(engine, "0001")
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    with engine.begin() as conn:
        for i in range(3):
            conn.execute(text(
                "INSERT INTO events (at, actor, host, action, repository, tag, digest, "
                "outcome, detail) VALUES (:at, 'old@box', 'box', 'push', 'r/a', 'v1', NULL, "
                "'ok', :detail)"), {"at": at + timedelta(seconds=i), "detail": f'{{"i":{i}}}'})
    engine.dispose()
    catalog = Catalog.open(catalog_url, auto_upgrade=True)
    catalog.add_event(_event("tag"))
    report = catalog.event_chain()
    assert report.ok and report.events == 4
    assert [e.action for e in catalog.events()] == ["push", "push", "push", "tag"]
    catalog.close()


def test_the_migration_hashes_exactly_like_the_library() -> None:
    path = migrations_dir() / "versions" / "0002_event_chain_and_gc.py"
    spec = importlib.util.spec_from_file_location("m0002", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Row:
        actor, host, action, repository, tag = "a@b", "b", "push", "r/x", None
        digest, outcome, detail = "sha256:" + "1" * 64, "ok", '{"k":"é"}'

    naive = datetime(2026, 5, 6, 7, 8, 9, 12)
    assert module.GENESIS == GENESIS
    assert module._event_hash(7, GENESIS, naive, Row) == event_hash(7, GENESIS, naive, vars(Row))


def test_log_command(make_registry: RegistryFactory, cli_env: dict[str, str],
                     tmp_path: Path) -> None:
    reg: Registry = make_registry(home=tmp_path / "home")
    src = write_synthetic(tmp_path / "a.kv", tokens=300)
    other = write_synthetic(tmp_path / "b.kv", tokens=300, seed=3)
    digest = reg.push(src, "log/a:v1").digest
    reg.push(other, "log/b:v1")
    reg.pull("log/a:v1")
    reg.close()
    runner = CliRunner(env=cli_env)
    r = runner.invoke(cli, ["log", "--json"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["action"] for e in lines] == ["push", "push", "pull"]
    assert {"at", "actor", "host", "action", "repository", "tag", "digest", "outcome",
            "detail"} <= set(lines[0])
    r = runner.invoke(cli, ["log", "log/a:v1", "--action", "pull", "--json"])
    assert [json.loads(line)["digest"] for line in r.stdout.splitlines()] == [str(digest)]
    r = runner.invoke(cli, ["log", "--since", "1h", "--json"])
    assert len(r.stdout.splitlines()) == 3
    r = runner.invoke(cli, ["log", "--since", (datetime.now(UTC) + timedelta(hours=1))
                            .isoformat(), "--json"])
    assert r.exit_code == 0 and r.stdout == ""
    r = runner.invoke(cli, ["log"])
    assert r.exit_code == 0 and "log/a:v1" in r.stdout and "pull" in r.stdout
    r = runner.invoke(cli, ["log", "--since", "yesterday-ish"])
    assert r.exit_code == 2 and "not a time or duration" in r.output
    r = runner.invoke(cli, ["log", "log/nothing:here"])
    assert r.exit_code == 3


def test_a_corrupt_digest_in_the_log_is_an_integrity_error(
        make_registry: RegistryFactory, catalog_url: str, cli_env: dict[str, str],
        tmp_path: Path) -> None:
    from kvgraft.errors import IntegrityError

    Catalog.open(catalog_url, auto_upgrade=True).close()
    reg = make_registry(catalog_url=catalog_url, home=tmp_path / "home")
    reg.push(write_synthetic(tmp_path / "a.kv", tokens=300), "log/a:v1")
    bad = "sha256:" + "z" * 64
    tamper(sql_catalog(reg), "UPDATE events SET digest = :d", d=bad)
    # Damage found in the catalog, not a malformed request: exit 4, not 2.
    with pytest.raises(IntegrityError, match=f"events table holds a malformed digest '{bad}'"):
        reg.log()
    reg.close()
    r = CliRunner(env={**cli_env, "KVGRAFT_CATALOG_URL": catalog_url}).invoke(cli, ["log"])
    assert r.exit_code == 4, r.output
    assert bad in r.stderr

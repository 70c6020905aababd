"""Catalog contract tests, run on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Table, text

from kvgraft.blobstore.memory import MemoryBlobStore
from kvgraft.catalog import Catalog, EventRecord, PushRecord
from kvgraft.catalog.engine import make_engine
from kvgraft.catalog.models import Base
from kvgraft.catalog.records import AttestationRecord, BlobRecord
from kvgraft.catalog.schema import head_revision
from kvgraft.digest import Digest
from kvgraft.errors import CatalogOutdated, NotFound, Unavailable, UsageError
from kvgraft.formats.manifest import Manifest
from kvgraft.reference import Reference
from kvgraft.transfer.push import PushOptions, build_artifact
from tests.support.synthetic import write_synthetic


def _event(action: str = "push", **kw: object) -> EventRecord:
    return EventRecord(action=action, actor="me@here", host="here", **kw)  # type: ignore[arg-type]


def _manifest(tmp_path: Path, seed: int = 0) -> tuple[Manifest, tuple[BlobRecord, ...]]:
    src = write_synthetic(tmp_path / f"{seed}.kv", tokens=300, seed=seed)
    upload = build_artifact(src, MemoryBlobStore(f"cat-{seed}-{tmp_path}"), PushOptions())
    return upload.manifest, upload.blobs


def test_migrated_schema_matches_the_orm(catalog_url: str) -> None:
    catalog = Catalog.open(catalog_url, auto_upgrade=True)
    with catalog.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    catalog.close()
    assert diff == []


def test_reader_tags_table_matches_the_orm() -> None:
    from kvgraft.catalog.models import TagRow
    from kvgraft.catalog.reader import TAGS

    orm = TagRow.__table__
    assert isinstance(orm, Table)  # typed as FromClause: the declarative base made a Table
    assert TAGS.name == orm.name
    assert {c.name: type(c.type) for c in TAGS.c} == \
        {c.name: type(c.type) for c in orm.c if c.name in TAGS.c}
    assert set(orm.c.keys()) == set(TAGS.c.keys())


def test_reader_lists_what_the_catalog_lists_over_one_engine(
        catalog_url: str, tmp_path: Path) -> None:
    from kvgraft.catalog.reader import CatalogReader

    catalog = Catalog.open(catalog_url, auto_upgrade=True)
    m, blobs = _manifest(tmp_path)
    catalog.record_push(PushRecord(m, blobs, "t/a_b", "v1", {}, _event(digest=m.digest)))
    catalog.record_push(PushRecord(m, blobs, "t/axb", "v1", {}, _event(digest=m.digest)))
    reader = CatalogReader.open(catalog_url)
    assert reader.list_tags() == catalog.list_tags()
    # `_` is a LIKE wildcard: the listing escapes it, and the caller's glob decides.
    assert [t.repository for t in reader.list_tags("t/a_*")] == ["t/a_b"]
    assert [t.repository for t in reader.list_tags("t/a?b")] == ["t/a_b", "t/axb"]
    full = Catalog.from_reader(reader)
    assert full.engine is reader.engine and Catalog.from_reader(full) is full
    assert full.resolve(Reference.parse("t/axb:v1")) == m.digest
    reader.close()
    catalog.close()


def test_head_constant_matches_the_migration_scripts() -> None:
    from kvgraft.catalog.schema import script_head

    assert head_revision() == script_head()


def test_catalog_behind_refuses_and_names_the_fix(catalog_url: str) -> None:
    with pytest.raises(CatalogOutdated, match="kvgraft db upgrade") as e:
        Catalog.open(catalog_url)
    assert e.value.exit_code == 7
    Catalog.open(catalog_url, auto_upgrade=True).close()
    catalog = Catalog.open(catalog_url)  # now current: opens without upgrading
    assert catalog.current_revision() == head_revision()
    with catalog.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'f00d'"))
    with pytest.raises(CatalogOutdated, match="newer than this kvgraft"):
        catalog.check_schema(auto_upgrade=True)
    catalog.close()


def test_record_push_is_idempotent(catalog_url: str, tmp_path: Path) -> None:
    catalog = Catalog.open(catalog_url, auto_upgrade=True)
    m, blobs = _manifest(tmp_path)
    push = PushRecord(m, blobs, "t/a", "v1", {"k": "v"}, _event(digest=m.digest))
    first = catalog.record_push(push)
    second = catalog.record_push(push)
    assert first.created and not second.created
    assert second.previous == m.digest
    assert catalog.resolve(Reference.parse("t/a:v1")) == m.digest
    record = catalog.artifact(m.digest)
    assert Manifest.parse(record.manifest, m.digest) == m
    assert record.size == m.size
    assert record.stored_size == sum(b.stored_size for b in blobs)
    assert record.labels == {"k": "v"}
    assert [(t.repository, t.tag) for t in record.tags] == [("t/a", "v1")]
    assert len(catalog.events(digest=m.digest, action="push")) == 2
    assert set(catalog.blob_records(b.digest for b in blobs)) == {b.digest for b in blobs}
    catalog.close()


def test_tags_move_and_untag(catalog_url: str, tmp_path: Path) -> None:
    catalog = Catalog.open(catalog_url, auto_upgrade=True)
    m1, b1 = _manifest(tmp_path, 1)
    m2, b2 = _manifest(tmp_path, 2)
    catalog.record_push(PushRecord(m1, b1, "t/a", "x", {}, _event()))
    out = catalog.record_push(PushRecord(m2, b2, "t/a", "x", {}, _event()))
    assert out.previous == m1.digest
    assert catalog.resolve(Reference.parse("t/a:x")) == m2.digest
    assert catalog.set_tag("t/b", "y", m1.digest, _event("tag")) is None
    assert catalog.resolve(Reference.parse(f"t/b@{m1.digest}")) == m1.digest
    assert [t.repository for t in catalog.list_tags("t/*")] == ["t/a", "t/b"]
    assert [t.repository for t in catalog.list_tags("t/_")] == []  # '_' is literal
    assert catalog.remove_tag("t/a", "x", _event("untag")) == m2.digest
    with pytest.raises(NotFound):
        catalog.remove_tag("t/a", "x", _event("untag"))
    with pytest.raises(NotFound):
        catalog.set_tag("t/a", "x", Digest("0" * 64), _event("tag"))
    assert [e.action for e in catalog.events()] == ["push", "push", "tag", "untag"]
    assert catalog.events(action="untag")[0].digest == m2.digest
    catalog.close()


def test_attestations_round_trip(catalog_url: str, tmp_path: Path) -> None:
    catalog = Catalog.open(catalog_url, auto_upgrade=True)
    m, blobs = _manifest(tmp_path)
    catalog.record_push(PushRecord(m, blobs, "t/a", None, {}, _event()))
    att = AttestationRecord(m.digest, "https://example/p", b'{"x":1}')
    catalog.add_attestation(att, _event("verify-graft", digest=m.digest))
    got = catalog.attestations(m.digest)
    assert [(a.predicate_type, a.statement) for a in got] == [("https://example/p", b'{"x":1}')]
    with pytest.raises(NotFound):
        catalog.add_attestation(AttestationRecord(Digest("1" * 64), "p", b"{}"))
    catalog.close()


def test_unreachable_catalog_is_unavailable() -> None:
    with pytest.raises(Unavailable, match=r"127\.0\.0\.1") as e:
        Catalog.open("postgresql+psycopg://nobody:secret@127.0.0.1:1/none?connect_timeout=2")
    assert "secret" not in e.value.message
    assert e.value.exit_code == 7


@pytest.mark.parametrize("url", ["mysql://x/y", "not a url", "sqlite+nothing:///x"])
def test_bad_catalog_urls(url: str) -> None:
    with pytest.raises(UsageError):
        make_engine(url)


def test_pooled_connection_pinged_only_after_idle(postgres_url: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection back from use within PING_AFTER_IDLE_S is handed out as it is; one
    idle longer is pinged first, and a dead one replaced without the caller seeing it."""
    from sqlalchemy.exc import OperationalError

    from kvgraft.catalog import engine as engine_module

    engine = make_engine(postgres_url)
    pings: list[object] = []
    ping = engine.dialect.do_ping

    def counted(conn: Any) -> bool:
        pings.append(conn)
        return ping(conn)

    monkeypatch.setattr(engine.dialect, "do_ping", counted)
    admin = make_engine(postgres_url)

    def backend() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())

    def kill(pid: int) -> None:
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})

    try:
        monkeypatch.setattr(engine_module, "PING_AFTER_IDLE_S", 3600.0)
        first = backend()
        assert backend() == first and pings == []  # just used: no ping
        monkeypatch.setattr(engine_module, "PING_AFTER_IDLE_S", 0.0)
        assert backend() == first and len(pings) == 1  # idle: pinged, alive, kept
        kill(first)
        second = backend()  # pinged, found dead, replaced
        assert second != first and len(pings) == 2
        # Without the ping, the server going away shows in the one query that meets it,
        # and the pool starts afresh for the next.
        monkeypatch.setattr(engine_module, "PING_AFTER_IDLE_S", 3600.0)
        kill(second)
        with pytest.raises(OperationalError):
            backend()
        assert backend() not in (first, second) and len(pings) == 2
    finally:
        engine.dispose()
        admin.dispose()

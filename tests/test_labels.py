"""Labels belong to an artifact within a repository: the migration that moved them there,
and that two repositories holding the same bytes keep their own (SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from sqlalchemy import create_engine, text

from kvgraft.catalog import Catalog
from kvgraft.catalog.schema import alembic_config, upgrade
from kvgraft.reference import Reference
from tests.support.harness import RegistryFactory
from tests.support.synthetic import write_synthetic


def test_migration_copies_each_label_to_every_repository_holding_it(
        catalog_url: str, tmp_path: Path, make_registry: RegistryFactory) -> None:
    engine = create_engine(catalog_url)
    upgrade(engine, "0004")
    digest = "sha256:" + "a" * 64
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO models (identity, architecture, tokenizer, name, config,"
                          " created_at) VALUES ('m', 'a', 't', 'n', '{}', CURRENT_TIMESTAMP)"))
        conn.execute(text(
            "INSERT INTO artifacts (digest, model_id, manifest, size, token_count, "
            "chunk_tokens, file_digest, file_size, created_at) SELECT :d, id, '{}', 1, 1, 1, "
            ":d, 1, CURRENT_TIMESTAMP FROM models"), {"d": digest})
        for repo in ("team/a", "other/b"):
            conn.execute(text("INSERT INTO repository_artifacts VALUES (:r, :d, "
                              "CURRENT_TIMESTAMP)"), {"r": repo, "d": digest})
        conn.execute(text("INSERT INTO labels VALUES (:d, 'owner', 'x')"), {"d": digest})
    upgrade(engine)
    with engine.begin() as conn:
        rows = conn.execute(text("SELECT repository, key, value FROM labels ORDER BY 1")).all()
    assert [tuple(r) for r in rows] == [("other/b", "owner", "x"), ("team/a", "owner", "x")]
    with engine.begin() as conn:  # and back: one set per artifact again
        cfg = alembic_config(engine)
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0004")
    with engine.begin() as conn:
        assert conn.execute(text("SELECT key, value FROM labels")).all() == [("owner", "x")]
    engine.dispose()


def test_same_bytes_in_two_repositories_keep_their_own_labels(
        catalog_url: str, tmp_path: Path, make_registry: RegistryFactory) -> None:
    Catalog.open(catalog_url, auto_upgrade=True).close()
    reg = make_registry(catalog_url=catalog_url)
    src = write_synthetic(tmp_path / "g.safetensors", tokens=32)
    first = reg.push(src, Reference.parse("other/board:q4"), labels={"owner": "other"})
    again = reg.push(src, Reference.parse("team/copy:v1"),
                     labels={"owner": "team", "approved": "no"})
    assert first.digest == again.digest
    assert dict(reg.inspect("other/board:q4").record.labels) == {"owner": "other"}
    assert dict(reg.inspect("team/copy:v1").record.labels) == {"owner": "team",
                                                               "approved": "no"}
    catalog = Catalog.open(catalog_url)
    record = catalog.artifact(first.digest)
    assert record.repository_labels == {"other/board": {"owner": "other"},
                                        "team/copy": {"owner": "team", "approved": "no"}}
    catalog.close()
    reg.close()

"""Changing a catalog's event log behind the library's back, as someone with database
access would: what the hash chain, audit and verification must catch."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from kvgraft.catalog import Catalog


def tamper(catalog: Catalog, sql: str, **params: Any) -> None:
    """Change the catalog behind the library's back, as someone with database access
    would: the append-only triggers are dropped first (that needs DDL rights, not magic)
    and put back afterwards, so only the hash chain can tell (audit reports triggers that
    stay missing: tests/test_tamper.py)."""
    with catalog.engine.connect() as conn:
        conn = conn.execution_options(kvgraft_write=True)
        with conn.begin():
            if conn.dialect.name == "sqlite":
                conn.exec_driver_sql("DROP TRIGGER IF EXISTS events_append_only_update")
                conn.exec_driver_sql("DROP TRIGGER IF EXISTS events_append_only_delete")
            else:
                conn.exec_driver_sql("DROP TRIGGER IF EXISTS events_append_only ON events")
            conn.execute(text(sql), params)
            if conn.dialect.name == "sqlite":
                for verb in ("UPDATE", "DELETE"):
                    conn.exec_driver_sql(
                        f"CREATE TRIGGER events_append_only_{verb.lower()} BEFORE {verb} ON "
                        "events BEGIN SELECT RAISE(ABORT, 'kvgraft events are append-only'); "
                        "END")
            else:
                conn.exec_driver_sql(
                    "CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events "
                    "FOR EACH ROW EXECUTE FUNCTION kvgraft_events_append_only()")


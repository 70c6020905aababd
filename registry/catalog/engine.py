"""Engines for the catalog URL: SQLite in WAL mode with a busy timeout, or PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from kvgraft.errors import MissingExtra, UsageError

SQLITE_BUSY_MS = 30_000


def safe_url(url: str) -> str:
    """The URL with any password hidden, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<malformed URL>"


def make_engine(url: str) -> Engine:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise UsageError(f"malformed catalog URL: {safe_url(url)}") from None
    backend = parsed.get_backend_name()
    try:
        if backend == "sqlite":
            return _sqlite_engine(url, parsed.database)
        if backend == "postgresql":
            try:
                return create_engine(url, pool_pre_ping=True)
            except ModuleNotFoundError:
                raise MissingExtra("a PostgreSQL catalog", "postgres") from None
    except NoSuchModuleError:
        raise UsageError(f"unknown database driver in catalog URL {safe_url(url)}") from None
    raise UsageError(
        f"unsupported catalog URL {safe_url(url)}",
        hint="use sqlite:///path or postgresql+psycopg://user@host/db",
    )


def _sqlite_engine(url: str, database: str | None) -> Engine:
    if database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_MS / 1000})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take over transaction control from pysqlite so writers can BEGIN IMMEDIATE.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # A deferred transaction that reads and then writes can fail with SQLITE_BUSY
        # without waiting; writers take the write lock up front and wait their turn.
        write = conn.get_execution_options().get("kvgraft_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine

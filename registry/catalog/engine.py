"""Engines for the catalog URL: SQLite in WAL mode with a busy timeout, or PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DisconnectionError, NoSuchModuleError

from kvgraft.errors import MissingExtra, Unavailable, UsageError

SQLITE_BUSY_MS = 30_000
PG_CONNECT_TIMEOUT = 10  # seconds
SQLITE_MAGIC = b"SQLite format 3\x00"
RESTORE_HINT = ("restore it from a backup, or move it aside to start an empty catalog "
                "(then run gc only with --allow-empty-catalog, once you are sure the store "
                "holds nothing you need)")


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
                # A catalog that accepts connections and never answers fails with exit 7
                # instead of hanging; `?connect_timeout=N` in the URL overrides it.
                args = {} if "connect_timeout" in parsed.query else \
                    {"connect_timeout": PG_CONNECT_TIMEOUT}
                engine = create_engine(url, connect_args=args)
                _ping_when_idle(engine)
                return engine
            except ModuleNotFoundError:
                raise MissingExtra("a PostgreSQL catalog", "postgres") from None
    except NoSuchModuleError:
        raise UsageError(f"unknown database driver in catalog URL {safe_url(url)}") from None
    raise UsageError(
        f"unsupported catalog URL {safe_url(url)}",
        hint="use sqlite:///path or postgresql+psycopg://user@host/db",
    )


PING_AFTER_IDLE_S = 1.0


def _ping_when_idle(engine: Engine) -> None:
    """Check a pooled connection that sat idle for PING_AFTER_IDLE_S before handing it
    out, as `pool_pre_ping` would check every one: a prefix lookup takes a connection per
    lookup, and the ping's round trip was a fifth of its CPU on both sides. A connection
    back from use within the last second is taken as alive; if the server went away in
    that second, the one query on it fails (exit 7), the pool drops its connections, and
    the next one connects afresh."""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since < PING_AFTER_IDLE_S:
            return  # a new connection, or one just used
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as e:
            # The pool discards this connection and checks out another (a new one when
            # none is left), as pool_pre_ping does.
            raise DisconnectionError(f"a pooled catalog connection is gone: {e}") from e


def _sqlite_engine(url: str, database: str | None) -> Engine:
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_MS / 1000})
    if database and database != ":memory:" and not database.startswith("file:"):
        ensure_sqlite_file(Path(database))

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


def ensure_sqlite_file(path: Path) -> None:
    """Create a missing catalog file; refuse one that exists but is not a SQLite database.

    SQLite itself would treat a zero-length file as a new database, and the embedded
    catalog would then upgrade itself into an empty one: every blob in the store would
    look unreferenced to gc. Only a missing file is created, and it is created whole (a
    valid empty database built beside it, then linked into place), so a second process
    starting at the same moment never sees a zero-length file either.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        _create_sqlite_file(path)
        return
    except OSError as e:
        raise Unavailable(f"cannot read the catalog file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise Unavailable(f"the catalog file {path} is not a regular file",
                          hint="point KVGRAFT_CATALOG_URL at a SQLite file")
    if st.st_size == 0:
        raise Unavailable(f"the catalog file {path} is empty (0 bytes); kvgraft does not "
                          "re-create an existing catalog", hint=RESTORE_HINT)
    try:
        with open(path, "rb") as f:
            magic = f.read(len(SQLITE_MAGIC))
    except OSError as e:
        raise Unavailable(f"cannot read the catalog file {path}: {e.strerror}") from None
    if magic != SQLITE_MAGIC:
        raise Unavailable(f"the catalog file {path} is not a SQLite database "
                          "(corrupt or overwritten)", hint=RESTORE_HINT)


def _create_sqlite_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp)
        try:
            # Writing the persistent WAL flag writes the database header: the file is a
            # valid (empty) database from the moment it has a name.
            conn.execute("PRAGMA journal_mode=WAL")
        finally:
            conn.close()
        with contextlib.suppress(FileExistsError):  # another process created it first
            os.link(tmp, path)
    finally:
        for leftover in (tmp, tmp + "-wal", tmp + "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)

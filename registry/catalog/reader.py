"""Opening a catalog, checking its schema, and the tag listing, in SQLAlchemy Core alone.

`kvgraft ls` and the like need no ORM: loading `sqlalchemy.orm` and building the mapped
classes of `models` costs a short command more than running it. `Catalog` (the ORM-backed
queries) extends `CatalogReader` and shares its engine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Self

from sqlalchemy import DateTime, Engine, String, column, select, table
from sqlalchemy.exc import DatabaseError, DBAPIError, OperationalError

from kvgraft.catalog import schema
from kvgraft.catalog.engine import RESTORE_HINT, make_engine, safe_url
from kvgraft.catalog.records import TagRecord, aware, stored_digest
from kvgraft.errors import CatalogOutdated, IntegrityError, Unavailable

# fnmatch's character set: `[`, an optional `!`, then up to the first `]` after one char.
_BRACKET = re.compile(r"\[!?.[^\]]*\]")

# The tags table as the listing reads it; the ORM mapping (models.TagRow) and this name
# the same columns of the table migrations/ creates (tests/test_catalog.py compares them).
TAGS = table("tags", column("repository", String), column("tag", String),
             column("artifact_digest", String), column("updated_at", DateTime(timezone=True)))


def like_pattern(pattern: str) -> str:
    """A SQL LIKE pattern (escape `\\`) that every repository the shell glob `pattern`
    matches also matches: `*`, `?` and `[...]` narrow the query; the caller applies the
    exact glob (fnmatch) to the rows."""
    like = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    like = _BRACKET.sub("?", like)  # a [set] is one character; fnmatch decides which
    return like.replace("*", "%").replace("?", "_")


def tag_records(rows: Iterable[tuple[str, str, str, datetime]],
                problems: list[str] | None = None) -> tuple[TagRecord, ...]:
    """Tag rows (repository, tag, digest, updated) as records. With `problems`, a row
    holding a malformed digest is reported there and skipped, so one damaged row does not
    hide every other tag; without, it raises."""
    out = []
    for repository, tag, digest_text, updated_at in rows:
        try:
            digest = stored_digest(digest_text, "tags", f"tag {repository}:{tag}")
        except IntegrityError as e:
            if problems is None:
                raise
            problems.append(e.message)
            continue
        out.append(TagRecord(repository, tag, digest, aware(updated_at)))
    return tuple(out)


class CatalogReader:
    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url

    @classmethod
    def open(cls, url: str, *, auto_upgrade: bool = False) -> Self:
        """The catalog at `url`, its schema at this kvgraft's head: an embedded catalog
        (`auto_upgrade`) is migrated, any other one that is behind is refused."""
        catalog = cls(make_engine(url), url)
        try:
            catalog.check_schema(auto_upgrade=auto_upgrade)
        except BaseException:
            catalog.close()
            raise
        return catalog

    def close(self) -> None:
        self.engine.dispose()

    def current_revision(self) -> str | None:
        with self._guard(), self.engine.connect() as conn:
            return schema.current_revision(conn)

    def upgrade(self) -> None:
        with self._guard():
            schema.upgrade(self.engine)

    def check_schema(self, *, auto_upgrade: bool) -> None:
        # The revision this code was written for is a constant: a catalog at head costs
        # one SELECT, and Alembic loads only when there is something to migrate or report.
        current, head = self.current_revision(), schema.head_revision()
        if current == head:
            return
        if current is not None and current not in schema.known_revisions():
            raise CatalogOutdated(
                f"catalog {safe_url(self.url)} is at revision {current}, newer than this "
                f"kvgraft knows (head {head})", hint="upgrade kvgraft")
        if auto_upgrade:
            self.upgrade()
            return
        raise CatalogOutdated(
            f"catalog {safe_url(self.url)} is at revision {current or 'none'}, this kvgraft "
            f"needs {head}", hint="run: kvgraft db upgrade")

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except OperationalError as e:
            raise Unavailable(
                f"catalog {safe_url(self.url)} is unavailable: {str(e.orig).strip()}") from None
        except DatabaseError as e:
            # Exactly DatabaseError (not its IntegrityError/DataError subclasses): SQLite's
            # "file is not a database" / "database disk image is malformed".
            if type(e) is not DatabaseError or self.engine.dialect.name != "sqlite":
                raise
            raise Unavailable(f"catalog {safe_url(self.url)} is corrupt: "
                              f"{str(e.orig).strip()}", hint=RESTORE_HINT) from None
        except DBAPIError as e:
            if e.connection_invalidated:
                raise Unavailable(
                    f"lost the connection to catalog {safe_url(self.url)}") from None
            raise

    def list_tags(self, pattern: str | None = None, *,
                  problems: list[str] | None = None) -> tuple[TagRecord, ...]:
        """Tags whose repository may match the shell-style `pattern` (see `like_pattern`)."""
        c = TAGS.c
        q = select(c.repository, c.tag, c.artifact_digest, c.updated_at)
        if pattern:
            q = q.where(c.repository.like(like_pattern(pattern), escape="\\"))
        with self._guard(), self.engine.connect() as conn, conn.begin():
            rows = conn.execute(q.order_by(c.repository, c.tag)).all()
        return tag_records(rows, problems)

"""Running and checking the Alembic migrations that define the catalog schema.

Alembic is imported only to migrate: checking a catalog's revision is one SELECT against
the revision this code was written for (`HEAD`, kept equal to migrations/ by a test), so
every command does not pay for loading the migration scripts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, inspect, text

from kvgraft.resources import migrations_dir

if TYPE_CHECKING:
    from alembic.config import Config

HEAD = "0007"
VERSION_TABLE = "alembic_version"


def alembic_config(engine: Engine | None = None) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if engine is not None:
        # '%' is interpolation syntax in alembic's config parser.
        cfg.set_main_option("sqlalchemy.url",
                            engine.url.render_as_string(False).replace("%", "%%"))
    return cfg


def head_revision() -> str:
    return HEAD


def script_head() -> str | None:
    """The head revision according to the migration scripts themselves."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def known_revisions() -> set[str]:
    from alembic.script import ScriptDirectory

    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def current_revision(conn: Connection) -> str | None:
    if not inspect(conn).has_table(VERSION_TABLE):
        return None
    return conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()


def upgrade(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    cfg = alembic_config(engine)
    with engine.connect() as conn:
        # Several processes may upgrade at first use: serialise them, then each re-reads
        # the version inside its own transaction and the later ones find nothing to do.
        conn = conn.execution_options(kvgraft_write=True)
        with conn.begin():
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7352917)")
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)

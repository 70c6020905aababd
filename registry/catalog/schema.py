"""Running and checking the Alembic migrations that define the catalog schema."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

from registry.resources import migrations_dir


def alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # '%' is interpolation syntax in alembic's config parser.
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(False).replace("%", "%%"))
    return cfg


def head_revision() -> str:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None, "migrations/ has no revisions"
    return head


def known_revisions() -> set[str]:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    return {s.revision for s in ScriptDirectory.from_config(cfg).walk_revisions()}


def current_revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
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

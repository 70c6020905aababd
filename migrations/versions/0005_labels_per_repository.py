"""labels per repository: (repository, artifact, key) instead of (artifact, key)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04

An artifact is shared by every repository that pushed the same bytes, so labels kept per
artifact let one tenant's push rewrite another's. Each existing label is copied to every
repository that holds its artifact (what each of them saw before), then the old table
goes. Built as a new table and renamed, the same on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _labels(name: str, *, per_repository: bool) -> None:
    repo = [sa.Column("repository", sa.String(length=255), nullable=False)] \
        if per_repository else []
    key = ["repository", "artifact_digest", "key"] if per_repository \
        else ["artifact_digest", "key"]
    op.create_table(
        name,
        *repo,
        sa.Column("artifact_digest", sa.String(length=71), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["artifact_digest"], ["artifacts.digest"],
                                name=op.f("fk_labels_artifact_digest_artifacts"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint(*key, name=op.f("pk_labels")),
    )


def upgrade() -> None:
    op.rename_table("labels", "labels_by_artifact")
    _drop_named_constraints("labels_by_artifact")
    _labels("labels", per_repository=True)
    op.execute("INSERT INTO labels (repository, artifact_digest, key, value) "
               "SELECT r.repository, l.artifact_digest, l.key, l.value "
               "FROM labels_by_artifact l JOIN repository_artifacts r "
               "ON r.artifact_digest = l.artifact_digest")
    op.drop_table("labels_by_artifact")
    op.create_index(op.f("ix_labels_artifact_digest"), "labels", ["artifact_digest"])


def downgrade() -> None:
    op.drop_index(op.f("ix_labels_artifact_digest"), table_name="labels")
    op.rename_table("labels", "labels_by_repository")
    _drop_named_constraints("labels_by_repository")
    _labels("labels", per_repository=False)
    # Back to one set per artifact: the first repository by name wins a key.
    op.execute("INSERT INTO labels (artifact_digest, key, value) "
               "SELECT artifact_digest, key, MIN(value) FROM labels_by_repository "
               "GROUP BY artifact_digest, key")
    op.drop_table("labels_by_repository")


def _drop_named_constraints(table: str) -> None:
    """PostgreSQL keeps constraint names across a rename (the new table wants them);
    SQLite's names live inside the table and go with it."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f'ALTER TABLE "{table}" RENAME CONSTRAINT "pk_labels" TO "pk_{table}"')
    op.execute(f'ALTER TABLE "{table}" RENAME CONSTRAINT '
               f'"fk_labels_artifact_digest_artifacts" TO "fk_{table}_artifact"')

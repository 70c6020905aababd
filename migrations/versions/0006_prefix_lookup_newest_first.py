"""prefix lookup at scale: artifact_chunks carries its artifact's created_at, indexed after
the prefix key

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04

Prefix lookup asks for the newest artifacts holding a prefix key. A key that thousands of
artifacts share (a system prompt's chunks) made that a join of every one of them with
`artifacts` and a sort: at a million chunk rows, 13,057 holders of one key, ~100,000
buffers, a quarter of a second from a cold cache (docs/deploy.md, "Catalog at scale"). With the artifact's creation time beside the key, (prefix_key, created_at,
artifact_digest) hands out the newest first, read backwards: a few index entries whatever
the key's popularity. The new index replaces ix_artifact_chunks_prefix_key, which is its
leading column.

On PostgreSQL the backfill is one UPDATE and the index build holds off writes to
artifact_chunks (pushes) while it runs. On SQLite
the NOT NULL is set in batch mode, which copies the table (artifact_chunks carries no
triggers to lose).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("artifact_chunks",
                  sa.Column("created_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE artifact_chunks SET created_at = (SELECT a.created_at FROM artifacts a "
               "WHERE a.digest = artifact_chunks.artifact_digest)")
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table("artifact_chunks", schema=None) as batch_op:
            batch_op.alter_column("created_at", existing_type=sa.DateTime(timezone=True),
                                  nullable=False)
    else:
        op.alter_column("artifact_chunks", "created_at",
                        existing_type=sa.DateTime(timezone=True), nullable=False)
    op.create_index("ix_artifact_chunks_prefix_key_created_at", "artifact_chunks",
                    ["prefix_key", "created_at", "artifact_digest"])
    op.drop_index("ix_artifact_chunks_prefix_key", table_name="artifact_chunks")


def downgrade() -> None:
    op.create_index("ix_artifact_chunks_prefix_key", "artifact_chunks", ["prefix_key"])
    op.drop_index("ix_artifact_chunks_prefix_key_created_at", table_name="artifact_chunks")
    with op.batch_alter_table("artifact_chunks", schema=None) as batch_op:
        batch_op.drop_column("created_at")

"""lifecycle: when each artifact was last used, pins, per-repository byte quotas

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05

`artifacts.last_used_at` is written with the event of a use (restore, pull, match) at most
once a minute per artifact; NULL means never used since it was pushed (docs/deploy.md,
"Lifecycle"). `repository_artifacts.pinned` exempts an artifact of that repository from
`gc --unused-for` and from quota eviction. `repository_quotas` holds the byte limit of a
repository's stored blobs. All three are additions: nothing is copied or rewritten.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("artifacts",
                  sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("repository_artifacts",
                  sa.Column("pinned", sa.Boolean(), nullable=False,
                            server_default=sa.false()))
    op.create_table(
        "repository_quotas",
        sa.Column("repository", sa.String(255), nullable=False),
        sa.Column("max_bytes", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("repository", name="pk_repository_quotas"),
    )


def downgrade() -> None:
    op.drop_table("repository_quotas")
    with op.batch_alter_table("repository_artifacts", schema=None) as batch_op:
        batch_op.drop_column("pinned")
    with op.batch_alter_table("artifacts", schema=None) as batch_op:
        batch_op.drop_column("last_used_at")

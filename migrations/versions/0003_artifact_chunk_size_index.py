"""index artifacts by (model_id, chunk_tokens) for prefix lookup

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain CREATE INDEX, not batch mode: batch mode would copy `artifacts` on SQLite.
    op.create_index("ix_artifacts_model_id_chunk_tokens", "artifacts",
                    ["model_id", "chunk_tokens"])


def downgrade() -> None:
    op.drop_index("ix_artifacts_model_id_chunk_tokens", table_name="artifacts")

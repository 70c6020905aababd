"""server: API tokens (hashed) and OCI content pushed by stock OCI clients

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04

`tokens` holds API tokens by the SHA-256 of their secret only; `scopes` is the scope text
they were created with. The `oci_*` tables hold what OCI clients push that is not a kvgraft
graft: blob links per repository (the bytes live in the blob store), manifests (their exact
bytes: a manifest's digest is over them), and tags of those manifests. `graft_oci_objects`
remembers which graft (and which of its attestations) an OCI digest the server rendered
stands for, so any worker resolves it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("secret_hash", sa.String(length=71), nullable=False),
        sa.Column("scopes", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=255), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tokens")),
        sa.UniqueConstraint("name", name=op.f("uq_tokens_name")),
        sa.UniqueConstraint("secret_hash", name=op.f("uq_tokens_secret_hash")),
    )
    op.create_table(
        "oci_blob_links",
        sa.Column("repository", sa.String(length=255), nullable=False),
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("repository", "digest", name=op.f("pk_oci_blob_links")),
    )
    op.create_index(op.f("ix_oci_blob_links_digest"), "oci_blob_links", ["digest"])
    op.create_table(
        "oci_manifests",
        sa.Column("repository", sa.String(length=255), nullable=False),
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.Column("media_type", sa.String(length=255), nullable=False),
        sa.Column("artifact_type", sa.String(length=255), nullable=True),
        sa.Column("subject", sa.String(length=71), nullable=True),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("blobs", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("repository", "digest", name=op.f("pk_oci_manifests")),
    )
    op.create_index(op.f("ix_oci_manifests_subject"), "oci_manifests", ["subject"])
    op.create_table(
        "oci_tags",
        sa.Column("repository", sa.String(length=255), nullable=False),
        sa.Column("tag", sa.String(length=128), nullable=False),
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("repository", "tag", name=op.f("pk_oci_tags")),
    )
    op.create_table(
        "graft_oci_objects",
        sa.Column("digest", sa.String(length=71), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("artifact_digest", sa.String(length=71), nullable=False),
        sa.Column("attestation_id", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("digest", "kind", name=op.f("pk_graft_oci_objects")),
    )


def downgrade() -> None:
    op.drop_table("graft_oci_objects")
    op.drop_table("oci_tags")
    op.drop_index(op.f("ix_oci_manifests_subject"), table_name="oci_manifests")
    op.drop_table("oci_manifests")
    op.drop_index(op.f("ix_oci_blob_links_digest"), table_name="oci_blob_links")
    op.drop_table("oci_blob_links")
    op.drop_table("tokens")

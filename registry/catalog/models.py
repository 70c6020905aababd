"""ORM mapping of the catalog tables. The schema itself comes only from migrations/."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

DIGEST = String(71)  # "sha256:" + 64 hex
NAME = String(255)

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class ModelRow(Base):
    __tablename__ = "models"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    identity: Mapped[str] = mapped_column(DIGEST, unique=True)
    architecture: Mapped[str] = mapped_column(DIGEST, index=True)
    tokenizer: Mapped[str] = mapped_column(DIGEST)
    weights: Mapped[str | None] = mapped_column(DIGEST, nullable=True)
    name: Mapped[str] = mapped_column(NAME)
    config: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class BlobRow(Base):
    __tablename__ = "blobs"
    digest: Mapped[str] = mapped_column(DIGEST, primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    stored_size: Mapped[int] = mapped_column(BigInteger)
    codec: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ArtifactRow(Base):
    __tablename__ = "artifacts"
    digest: Mapped[str] = mapped_column(DIGEST, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"), index=True)
    manifest: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column(BigInteger)
    token_count: Mapped[int] = mapped_column(BigInteger)
    chunk_tokens: Mapped[int] = mapped_column(Integer)
    file_digest: Mapped[str] = mapped_column(DIGEST)
    file_size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # Written with a use's event, at most once a minute (kvgraft.catalog.lifecycle).
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True),
                                                          nullable=True)

    # Prefix lookup asks which chunk sizes a model's artifacts use: with this index that is
    # one seek per distinct size instead of a scan of the model's artifacts.
    __table_args__ = (Index("ix_artifacts_model_id_chunk_tokens", "model_id", "chunk_tokens"),)


class ArtifactBlobRow(Base):
    """Every blob an artifact needs (header, tokens, chunks): what gc marks and verify reads."""

    __tablename__ = "artifact_blobs"
    artifact_digest: Mapped[str] = mapped_column(
        ForeignKey("artifacts.digest", ondelete="CASCADE"), primary_key=True
    )
    blob_digest: Mapped[str] = mapped_column(
        ForeignKey("blobs.digest"), primary_key=True, index=True
    )


class ArtifactChunkRow(Base):
    __tablename__ = "artifact_chunks"
    artifact_digest: Mapped[str] = mapped_column(
        ForeignKey("artifacts.digest", ondelete="CASCADE"), primary_key=True
    )
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    start: Mapped[int] = mapped_column(BigInteger)
    end: Mapped[int] = mapped_column(BigInteger)
    blob_digest: Mapped[str] = mapped_column(ForeignKey("blobs.digest"))
    prefix_key: Mapped[str] = mapped_column(DIGEST)
    # The artifact's created_at, copied: prefix lookup wants the newest artifacts holding a
    # key, and a key shared by thousands of artifacts (a system prompt) would otherwise
    # join and sort them all. With it in the index the newest are its first entries.
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_artifact_chunks_prefix_key_created_at", "prefix_key",
                            "created_at", "artifact_digest"),)


class RepositoryArtifactRow(Base):
    """Which repositories an artifact was pushed to (`name@sha256:…` resolves only there)."""

    __tablename__ = "repository_artifacts"
    repository: Mapped[str] = mapped_column(NAME, primary_key=True)
    artifact_digest: Mapped[str] = mapped_column(
        ForeignKey("artifacts.digest", ondelete="CASCADE"), primary_key=True, index=True
    )
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # Exempt from `gc --unused-for` and from quota eviction (kvgraft.catalog.lifecycle).
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")


class RepositoryQuotaRow(Base):
    """The most bytes of stored blobs a repository's artifacts may reference."""

    __tablename__ = "repository_quotas"
    repository: Mapped[str] = mapped_column(NAME, primary_key=True)
    max_bytes: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class TagRow(Base):
    __tablename__ = "tags"
    repository: Mapped[str] = mapped_column(NAME, primary_key=True)
    tag: Mapped[str] = mapped_column(String(128), primary_key=True)
    artifact_digest: Mapped[str] = mapped_column(ForeignKey("artifacts.digest"), index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class LabelRow(Base):
    """Labels belong to an artifact within a repository: tenants pushing the same bytes
    each keep their own."""

    __tablename__ = "labels"
    repository: Mapped[str] = mapped_column(NAME, primary_key=True)
    artifact_digest: Mapped[str] = mapped_column(
        ForeignKey("artifacts.digest", ondelete="CASCADE"), primary_key=True, index=True
    )
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class AttestationRow(Base):
    __tablename__ = "attestations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    artifact_digest: Mapped[str] = mapped_column(ForeignKey("artifacts.digest"), index=True)
    predicate_type: Mapped[str] = mapped_column(String(255))
    statement: Mapped[str] = mapped_column(Text)
    statement_digest: Mapped[str] = mapped_column(DIGEST)
    envelope: Mapped[str | None] = mapped_column(Text, nullable=True)
    keyid: Mapped[str | None] = mapped_column(String(255), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class EventRow(Base):
    """The append-only audit log: the library inserts rows and never updates or deletes."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    actor: Mapped[str] = mapped_column(String(255))
    host: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(64), index=True)
    repository: Mapped[str | None] = mapped_column(NAME, nullable=True)
    tag: Mapped[str | None] = mapped_column(String(128), nullable=True)
    digest: Mapped[str | None] = mapped_column(DIGEST, nullable=True, index=True)
    outcome: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str] = mapped_column(Text)
    # The hash chain (kvgraft.catalog.events): position, predecessor's hash, own hash.
    seq: Mapped[int] = mapped_column(BigInteger, unique=True, index=True)
    prev_hash: Mapped[str] = mapped_column(DIGEST)
    hash: Mapped[str] = mapped_column(DIGEST)


Index("ix_artifact_chunks_blob_digest", ArtifactChunkRow.blob_digest)


class BlobDeletionRow(Base):
    """Every blob gc deleted, written in the deleting transaction: a push that committed
    around a gc looks its blobs up here to learn whether it must upload them again."""

    __tablename__ = "blob_deletions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    digest: Mapped[str] = mapped_column(DIGEST, index=True)
    deleted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class TokenRow(Base):
    """An API token of `kvgraft serve`: only the SHA-256 of its secret is stored."""

    __tablename__ = "tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    secret_hash: Mapped[str] = mapped_column(DIGEST, unique=True)
    scopes: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_by: Mapped[str] = mapped_column(String(255))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class OciBlobLinkRow(Base):
    """A blob an OCI client pushed (or mounted) into a repository; bytes in the store."""

    __tablename__ = "oci_blob_links"
    repository: Mapped[str] = mapped_column(NAME, primary_key=True)
    digest: Mapped[str] = mapped_column(DIGEST, primary_key=True, index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class OciManifestRow(Base):
    """An OCI manifest (not a graft) as pushed: `content` is its exact bytes, `blobs` the
    JSON list of blob digests it references (what gc keeps)."""

    __tablename__ = "oci_manifests"
    repository: Mapped[str] = mapped_column(NAME, primary_key=True)
    digest: Mapped[str] = mapped_column(DIGEST, primary_key=True)
    media_type: Mapped[str] = mapped_column(String(255))
    artifact_type: Mapped[str | None] = mapped_column(String(255), nullable=True)
    subject: Mapped[str | None] = mapped_column(DIGEST, nullable=True, index=True)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    blobs: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class OciTagRow(Base):
    __tablename__ = "oci_tags"
    repository: Mapped[str] = mapped_column(NAME, primary_key=True)
    tag: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest: Mapped[str] = mapped_column(DIGEST)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class GraftOciObjectRow(Base):
    """What an OCI digest the server rendered stands for: a graft's OCI manifest
    (kind `manifest`), or one of its attestations as an OCI manifest (`attestation`) and
    that manifest's one layer (`attestation-blob`)."""

    __tablename__ = "graft_oci_objects"
    digest: Mapped[str] = mapped_column(DIGEST, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    artifact_digest: Mapped[str] = mapped_column(DIGEST)
    attestation_id: Mapped[int | None] = mapped_column(Integer, nullable=True)

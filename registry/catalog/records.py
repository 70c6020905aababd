"""Frozen values the catalog returns and takes; ORM rows stay inside the catalog."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, UsageError

if TYPE_CHECKING:  # the manifest's schema validation is not needed to read the catalog
    from kvgraft.formats.manifest import Manifest


def aware(t: datetime) -> datetime:
    """A catalog timestamp as an aware UTC datetime (SQLite hands back naive UTC)."""
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def stored_digest(text: str, table: str, row: str = "") -> Digest:
    """A digest read back from the catalog's `table`. One that does not parse means the
    catalog was damaged behind kvgraft's back: an integrity failure, not a bad request."""
    try:
        return Digest.parse(text)
    except UsageError:
        where = f" ({row})" if row else ""
        raise IntegrityError(f"the catalog's {table} table holds a malformed digest "
                             f"{text!r}{where}",
                             hint="it was changed outside kvgraft; restore it from a backup"
                             ) from None


@dataclass(frozen=True, slots=True)
class BlobRecord:
    digest: Digest
    size: int
    stored_size: int
    codec: str


@dataclass(frozen=True, slots=True)
class EventRecord:
    action: str
    actor: str
    host: str
    outcome: str = "ok"
    repository: str | None = None
    tag: str | None = None
    digest: Digest | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)
    at: datetime | None = None  # set by the catalog on insert
    id: int | None = None


@dataclass(frozen=True, slots=True)
class PushRecord:
    """Everything one push commits, in one transaction, after its blobs are stored."""

    manifest: Manifest
    blobs: tuple[BlobRecord, ...]
    repository: str
    tag: str | None
    labels: Mapping[str, str]
    event: EventRecord


@dataclass(frozen=True, slots=True)
class PushOutcome:
    created: bool  # False when the artifact was already in the catalog
    previous: Digest | None  # what the tag pointed at before, if anything
    # Artifacts the repository's quota evicted to make room (kvgraft.catalog.lifecycle).
    evicted: tuple[Digest, ...] = ()


@dataclass(frozen=True, slots=True)
class AttestationRecord:
    """A statement about an artifact digest (verification result, provenance, signature).

    `statement` is the canonical JSON of the statement; `envelope`, when set, is a signed
    envelope over it and `keyid` names the key that signed it.
    """

    artifact: Digest
    predicate_type: str
    statement: bytes
    envelope: bytes | None = None
    keyid: str | None = None
    created_at: datetime | None = None
    id: int | None = None

    @property
    def statement_digest(self) -> Digest:
        return Digest.of(self.statement)


@dataclass(frozen=True, slots=True)
class TagRecord:
    repository: str
    tag: str
    digest: Digest
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class ArtifactRecord:
    digest: Digest
    manifest: bytes  # canonical JSON as stored; parse with Manifest.parse(raw, digest)
    size: int
    stored_size: int
    token_count: int
    model_name: str
    created_at: datetime
    repositories: tuple[str, ...]
    tags: tuple[TagRecord, ...]
    labels: Mapping[str, str]  # in the repository it was asked about (Catalog.artifact)
    # Each repository's labels: tenants pushing the same bytes each keep their own.
    repository_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    last_used: datetime | None = None  # None: never used since it was pushed
    pinned: tuple[str, ...] = ()  # the repositories that pin it

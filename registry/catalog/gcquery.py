"""The catalog queries gc needs: the inventory it plans from, the lock that holds off
push commits, and the deletions it carries out under that lock (see kvgraft.transfer.gc)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, exists, func, insert, or_, select, text
from sqlalchemy.orm import Session

from kvgraft.catalog.lineage import stored_parents
from kvgraft.catalog.models import (
    ArtifactBlobRow,
    ArtifactRow,
    AttestationRow,
    BlobDeletionRow,
    BlobRow,
    OciBlobLinkRow,
    OciManifestRow,
    RepositoryArtifactRow,
    TagRow,
)
from kvgraft.catalog.records import BlobRecord, aware, stored_digest
from kvgraft.digest import Digest

BlobDeleter = Callable[[Digest], bool]  # True when the blob is gone from the store
DELETIONS_KEPT = timedelta(days=30)  # pushes that span longer than this are not protected
_BATCH = 500


@dataclass(frozen=True, slots=True)
class ArtifactLinks:
    """What gc needs to know of one artifact."""

    digest: Digest
    created_at: datetime
    tagged: bool
    parents: tuple[Digest, ...] | None  # None: the stored manifest cannot say (corrupt)
    blobs: tuple[Digest, ...]
    last_used: datetime | None = None  # None: never since it was pushed
    pinned: bool = False  # in some repository

    @property
    def used_at(self) -> datetime:
        """When it was last used, its push counting as a use."""
        return self.last_used or self.created_at


def _chunks(keys: list[str]) -> Iterable[list[str]]:
    for i in range(0, len(keys), _BATCH):
        yield keys[i:i + _BATCH]


def inventory(s: Session) -> list[ArtifactLinks]:
    tagged = set(s.scalars(select(TagRow.artifact_digest).distinct()))
    blobs: dict[str, list[Digest]] = {}
    parsed: dict[str, Digest] = {}  # artifacts sharing a prefix share its chunks' blobs
    for a, b in s.execute(select(ArtifactBlobRow.artifact_digest, ArtifactBlobRow.blob_digest)):
        d = parsed.get(b)
        if d is None:
            d = parsed[b] = stored_digest(b, "artifact_blobs")
        blobs.setdefault(a, []).append(d)
    pinned = set(s.scalars(select(RepositoryArtifactRow.artifact_digest).distinct()
                           .where(RepositoryArtifactRow.pinned)))
    rows = s.execute(select(ArtifactRow.digest, ArtifactRow.created_at, ArtifactRow.manifest,
                            ArtifactRow.last_used_at).order_by(ArtifactRow.created_at))
    return [ArtifactLinks(stored_digest(d, "artifacts"), aware(at), d in tagged,
                          stored_parents(d, raw), tuple(blobs.get(d, ())),
                          aware(used) if used else None, d in pinned)
            for d, at, raw, used in rows]


def lock_for_gc(s: Session) -> None:
    """Hold off every push commit for the rest of this transaction (see kvgraft.transfer.gc).

    A push commit writes `blobs` first, then `artifacts` and `artifact_blobs`, holding
    ROW EXCLUSIVE on each until it commits; SHARE ROW EXCLUSIVE waits for those and
    blocks new ones. SQLite writers already exclude each other (BEGIN IMMEDIATE)."""
    if s.get_bind().dialect.name == "postgresql":
        # oci_blob_links, oci_manifests: what `kvgraft serve` writes for OCI clients.
        s.execute(text("LOCK TABLE blobs, artifacts, artifact_blobs, oci_blob_links, "
                       "oci_manifests IN SHARE ROW EXCLUSIVE MODE"))


def delete_artifacts(s: Session, digests: Iterable[Digest], created_before: datetime | None,
                     unused_before: datetime | None = None) -> list[Digest]:
    """Delete, of `digests`, those pinned nowhere that are untagged and created before
    `created_before`, or unused since `unused_before` (their tags go with them)."""
    a = ArtifactRow
    untagged = ~exists().where(TagRow.artifact_digest == a.digest)
    rules = []
    if created_before is not None:
        rules.append(and_(a.created_at < created_before, untagged))
    if unused_before is not None:
        rules.append(func.coalesce(a.last_used_at, a.created_at) < unused_before)
    if not rules:
        return []
    gone: list[Digest] = []
    for keys in _chunks([str(d) for d in digests]):
        locked = list(s.scalars(select(a.digest).where(
            a.digest.in_(keys), or_(*rules)).with_for_update()))
        # A tag, pin or use that committed while we waited for those row locks saves its
        # artifact; a fresh statement sees it (READ COMMITTED).
        saved: set[str] = set()
        if locked:
            saved |= set(s.scalars(select(RepositoryArtifactRow.artifact_digest).where(
                RepositoryArtifactRow.artifact_digest.in_(locked),
                RepositoryArtifactRow.pinned)))
            expired = set() if unused_before is None else set(s.scalars(
                select(a.digest).where(a.digest.in_(locked), func.coalesce(
                    a.last_used_at, a.created_at) < unused_before)))
            saved |= set(s.scalars(select(TagRow.artifact_digest).where(
                TagRow.artifact_digest.in_([d for d in locked if d not in expired]))))
            if created_before is None:
                saved |= {d for d in locked if d not in expired}
        doomed = [d for d in locked if d not in saved]
        if not doomed:
            continue
        s.execute(delete(AttestationRow).where(AttestationRow.artifact_digest.in_(doomed)))
        s.execute(delete(TagRow).where(TagRow.artifact_digest.in_(doomed)))
        # Chunks, blob links, labels and repository links go with it (ON DELETE CASCADE).
        s.execute(delete(ArtifactRow).where(ArtifactRow.digest.in_(doomed)))
        gone += [stored_digest(d, "artifacts") for d in doomed]
    return sorted(gone)


def prune_deletions(s: Session, now: datetime) -> None:
    s.execute(delete(BlobDeletionRow).where(BlobDeletionRow.deleted_at < now - DELETIONS_KEPT))


def record_deletions(s: Session, digests: Iterable[Digest], now: datetime) -> None:
    rows = [{"digest": str(d), "deleted_at": now} for d in digests]
    if rows:
        s.execute(insert(BlobDeletionRow), rows)


def sweep(s: Session, digests: list[Digest], delete_blob: BlobDeleter,
          planned_at: datetime, uploaded_after: datetime) -> list[Digest]:
    referenced: set[str] = set()
    for keys in _chunks([str(d) for d in digests]):
        referenced.update(s.scalars(select(ArtifactBlobRow.blob_digest).distinct()
                                    .where(ArtifactBlobRow.blob_digest.in_(keys))))
        referenced.update(s.scalars(select(OciBlobLinkRow.digest).distinct().where(
            OciBlobLinkRow.digest.in_(keys), OciBlobLinkRow.created_at >= uploaded_after)))
    for raw in s.scalars(select(OciManifestRow.blobs).where(
            OciManifestRow.created_at >= planned_at)):
        referenced.update(json.loads(raw))
    gone = [d for d in digests if str(d) not in referenced and delete_blob(d)]
    for keys in _chunks([str(d) for d in gone]):
        s.execute(delete(BlobRow).where(BlobRow.digest.in_(keys)))
        s.execute(delete(OciBlobLinkRow).where(OciBlobLinkRow.digest.in_(keys)))
    return gone


def deleted_among(s: Session, digests: Iterable[Digest]) -> set[Digest]:
    out: set[Digest] = set()
    for keys in _chunks(sorted({str(d) for d in digests})):
        out.update(stored_digest(d, "blob_deletions") for d in s.scalars(
            select(BlobDeletionRow.digest).distinct().where(BlobDeletionRow.digest.in_(keys))))
    return out


def refresh_blobs(s: Session, upsert: Any, blobs: Iterable[BlobRecord], now: datetime) -> None:
    for b in blobs:
        s.execute(upsert.values(digest=str(b.digest), size=b.size, stored_size=b.stored_size,
                                codec=b.codec, created_at=now).on_conflict_do_update(
            index_elements=["digest"], set_={"stored_size": b.stored_size, "codec": b.codec}))

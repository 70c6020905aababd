"""Lifecycle queries: when artifacts were last used, pins, and repository byte quotas.

Last use. An event of a use (action restore, pull or match, outcome ok, naming an artifact)
sets `artifacts.last_used_at` in the event's own transaction, so the use and its record
commit together and nothing else writes it. A use within `USE_RESOLUTION` of the recorded
one writes nothing: a graft restored a thousand times a second costs one row write a
minute, and last use is known to the minute. Uses are recorded where their events are
written: off an engine's request path (the vLLM connector and the llama.cpp prompt cache
queue their events on a background thread), after the data is on disk for a pull. What a
crash loses is what those queues held: the uses of the last moments before it.

An artifact never used since it was pushed counts as used when it was pushed.

Pins belong to an artifact within a repository (`repository_artifacts.pinned`), like
labels: one tenant's pin neither needs nor gives power over another's copy.

Quotas. A repository's bytes are those of the distinct stored blobs its artifacts
reference, what `kvgraft stats` reports as stored_bytes. A push or tag that would take a
repository with a quota past it first evicts that repository's least recently used
unpinned artifacts (their tags and labels there, and their place in it; the bytes leave
the store at the next gc, by the gc rules, so a chunk another artifact references stays),
in the same transaction; when the newcomer still does not fit, nothing of it commits.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from kvgraft.catalog.models import (
    ArtifactBlobRow,
    ArtifactRow,
    BlobRow,
    LabelRow,
    RepositoryArtifactRow,
    RepositoryQuotaRow,
    TagRow,
)
from kvgraft.catalog.records import EventRecord, aware, stored_digest
from kvgraft.catalog.usage import USE_ACTIONS
from kvgraft.digest import Digest
from kvgraft.errors import NotFound, QuotaExceeded

USE_RESOLUTION = timedelta(minutes=1)


def note_use(s: Session, e: EventRecord, now: datetime) -> None:
    """Inside the transaction writing `e`: when it records a use, the artifact's last use
    becomes `now` (unless it was already within USE_RESOLUTION of it)."""
    if e.digest is None or e.outcome != "ok" or e.action not in USE_ACTIONS:
        return
    a = ArtifactRow
    s.execute(update(a).where(a.digest == str(e.digest), or_(
        a.last_used_at.is_(None), a.last_used_at < now - USE_RESOLUTION))
        .values(last_used_at=now))


def set_pin(s: Session, repository: str, digest: Digest, pinned: bool) -> None:
    ra = RepositoryArtifactRow
    done = s.execute(update(ra).where(ra.repository == repository,
                                      ra.artifact_digest == str(digest))
                     .values(pinned=pinned))
    if not getattr(done, "rowcount", 0):
        raise NotFound(f"artifact {digest} is not in {repository}")


def pinned_in(s: Session, digest: Digest) -> tuple[str, ...]:
    ra = RepositoryArtifactRow
    return tuple(s.scalars(select(ra.repository).where(
        ra.artifact_digest == str(digest), ra.pinned).order_by(ra.repository)))


def set_quota(s: Session, upsert: Any, repository: str, max_bytes: int | None,
              now: datetime) -> int | None:
    """Set (or, with None, remove) `repository`'s quota; returns the one it had."""
    q = RepositoryQuotaRow
    old = s.scalar(select(q.max_bytes).where(q.repository == repository))
    if max_bytes is None:
        s.execute(delete(q).where(q.repository == repository))
    else:
        s.execute(upsert.values(repository=repository, max_bytes=max_bytes, updated_at=now)
                  .on_conflict_do_update(index_elements=["repository"],
                                         set_={"max_bytes": max_bytes, "updated_at": now}))
    return None if old is None else int(old)


def quotas(s: Session) -> dict[str, int]:
    q = select(RepositoryQuotaRow.repository, RepositoryQuotaRow.max_bytes)
    return {r: int(b) for r, b in s.execute(q.order_by(RepositoryQuotaRow.repository))}


def held_bytes(s: Session, repository: str) -> int:
    """Stored bytes of the distinct blobs `repository`'s artifacts reference."""
    ra = RepositoryArtifactRow
    blobs = select(ArtifactBlobRow.blob_digest).distinct() \
        .join(ra, ra.artifact_digest == ArtifactBlobRow.artifact_digest) \
        .where(ra.repository == repository).subquery()
    return int(s.scalar(select(func.coalesce(func.sum(BlobRow.stored_size), 0))
                        .join(blobs, blobs.c.blob_digest == BlobRow.digest)) or 0)


def enforce_quota(s: Session, repository: str, newcomer: str) -> list[Digest]:
    """Inside the transaction that put `newcomer` in `repository`: evict least recently
    used unpinned artifacts until the repository fits its quota, or raise QuotaExceeded
    (the caller's transaction then rolls back, evictions included). Returns the evicted."""
    limit = s.scalar(select(RepositoryQuotaRow.max_bytes)
                     .where(RepositoryQuotaRow.repository == repository))
    if limit is None:
        return []
    held = before = held_bytes(s, repository)
    if held <= limit:
        return []
    ra = RepositoryArtifactRow
    # What each artifact of the repository references, and how many of them share a blob:
    # evicting one frees the bytes of the blobs no other artifact of the repository holds.
    refs: dict[str, list[tuple[str, int]]] = {}
    for art, blob, size in s.execute(
            select(ArtifactBlobRow.artifact_digest, ArtifactBlobRow.blob_digest,
                   BlobRow.stored_size)
            .join(BlobRow, BlobRow.digest == ArtifactBlobRow.blob_digest)
            .join(ra, ra.artifact_digest == ArtifactBlobRow.artifact_digest)
            .where(ra.repository == repository)):
        refs.setdefault(art, []).append((blob, int(size)))
    holders: dict[str, int] = {}
    for blobs in refs.values():
        for blob, _ in set(blobs):
            holders[blob] = holders.get(blob, 0) + 1
    candidates = sorted(
        ((aware(used or created), art) for art, created, used in s.execute(
            select(ra.artifact_digest, ArtifactRow.created_at, ArtifactRow.last_used_at)
            .join(ArtifactRow, ArtifactRow.digest == ra.artifact_digest)
            .where(ra.repository == repository, ~ra.pinned,
                   ra.artifact_digest != newcomer))))
    evicted: list[str] = []
    for _, art in candidates:
        if held <= limit:
            break
        for blob, size in set(refs.get(art, ())):
            holders[blob] -= 1
            if holders[blob] == 0:
                held -= size
        evicted.append(art)
    if held > limit:
        raise QuotaExceeded(
            f"{repository} would hold {before} bytes with its quota of {limit}: "
            f"{newcomer} does not fit even with every unpinned artifact evicted",
            hint=f"raise the quota (`kvgraft quota set {repository} SIZE`) or unpin "
                 "artifacts there")
    for i in range(0, len(evicted), 500):
        keys = evicted[i:i + 500]
        for table in (TagRow, LabelRow, RepositoryArtifactRow):
            s.execute(delete(table).where(table.repository == repository,
                                          table.artifact_digest.in_(keys)))
    return [stored_digest(d, "repository_artifacts") for d in evicted]

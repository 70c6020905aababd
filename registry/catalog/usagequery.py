"""The queries behind `kvgraft stats` (what the figures mean: kvgraft.catalog.usage)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvgraft.catalog.models import (
    ArtifactBlobRow,
    ArtifactRow,
    BlobRow,
    EventRow,
    RepositoryArtifactRow,
    TagRow,
)
from kvgraft.catalog.records import aware
from kvgraft.catalog.usage import USE_ACTIONS, RepositoryUsage, UsageReport


def repository_names(s: Session, pattern: str | None = None) -> list[str]:
    """Every repository holding an artifact or a tag (shell glob `pattern`, if given)."""
    names = set(s.scalars(select(RepositoryArtifactRow.repository).distinct()))
    names |= set(s.scalars(select(TagRow.repository).distinct()))
    return sorted(n for n in names if pattern is None or fnmatch.fnmatchcase(n, pattern))


def usage(s: Session, names: Sequence[str]) -> UsageReport:
    """The figures of the repositories `names`, and their total."""
    ra = RepositoryArtifactRow
    held = select(ra.repository, ra.artifact_digest).where(ra.repository.in_(names)).subquery()
    rows: dict[str, dict[str, Any]] = {n: {} for n in names}
    for repo, n, size in s.execute(
            select(held.c.repository, func.count(), func.coalesce(func.sum(ArtifactRow.size), 0))
            .join(ArtifactRow, ArtifactRow.digest == held.c.artifact_digest)
            .group_by(held.c.repository)):
        rows[repo].update(artifacts=int(n), size=int(size))
    for repo, n in s.execute(select(TagRow.repository, func.count())
                             .where(TagRow.repository.in_(names)).group_by(TagRow.repository)):
        rows[repo]["tags"] = int(n)
    for repo, referenced in s.execute(
            select(held.c.repository, func.sum(BlobRow.stored_size))
            .join(ArtifactBlobRow, ArtifactBlobRow.artifact_digest == held.c.artifact_digest)
            .join(BlobRow, BlobRow.digest == ArtifactBlobRow.blob_digest)
            .group_by(held.c.repository)):
        rows[repo]["referenced_bytes"] = int(referenced or 0)
    blobs = select(held.c.repository, ArtifactBlobRow.blob_digest).distinct() \
        .join(ArtifactBlobRow, ArtifactBlobRow.artifact_digest == held.c.artifact_digest) \
        .subquery()
    for repo, stored in s.execute(
            select(blobs.c.repository, func.sum(BlobRow.stored_size))
            .join(BlobRow, BlobRow.digest == blobs.c.blob_digest).group_by(blobs.c.repository)):
        rows[repo]["stored_bytes"] = int(stored or 0)
    for repo, (hits, last) in _hits(s, names).items():
        rows[repo].update(hits=hits, last_used=last)
    per_repo = tuple(RepositoryUsage(n, **rows[n]) for n in names)
    return UsageReport(per_repo, _total(s, names, per_repo))


def _hits(s: Session, names: Sequence[str]) -> dict[str, tuple[int, datetime | None]]:
    used = (EventRow.action.in_(USE_ACTIONS), EventRow.outcome == "ok")
    out: dict[str, tuple[int, datetime | None]] = {}

    def add(found: Iterable[Any]) -> None:
        for repo, n, last in found:
            had, had_last = out.get(repo, (0, None))
            last = aware(last) if last is not None else None
            latest = max((t for t in (had_last, last) if t is not None), default=None)
            out[repo] = (had + int(n), latest)

    add(s.execute(select(EventRow.repository, func.count(), func.max(EventRow.at))
                  .where(*used, EventRow.repository.in_(names))
                  .group_by(EventRow.repository)))
    ra = RepositoryArtifactRow
    add(s.execute(select(ra.repository, func.count(), func.max(EventRow.at))
                  .join(ra, ra.artifact_digest == EventRow.digest)
                  .where(*used, EventRow.repository.is_(None), ra.repository.in_(names))
                  .group_by(ra.repository)))
    return out


def _total(s: Session, names: Sequence[str], per_repo: Sequence[RepositoryUsage],
           ) -> RepositoryUsage:
    ra = RepositoryArtifactRow
    artifacts = select(ra.artifact_digest.label("digest")).distinct() \
        .where(ra.repository.in_(names)).subquery()
    n, size = s.execute(select(func.count(), func.coalesce(func.sum(ArtifactRow.size), 0))
                        .join(artifacts, artifacts.c.digest == ArtifactRow.digest)).one()
    referenced = s.scalar(select(func.coalesce(func.sum(BlobRow.stored_size), 0))
                          .join(ArtifactBlobRow, ArtifactBlobRow.blob_digest == BlobRow.digest)
                          .join(artifacts, artifacts.c.digest == ArtifactBlobRow.artifact_digest))
    blobs = select(ArtifactBlobRow.blob_digest.label("digest")).distinct() \
        .join(artifacts, artifacts.c.digest == ArtifactBlobRow.artifact_digest).subquery()
    stored = s.scalar(select(func.coalesce(func.sum(BlobRow.stored_size), 0))
                      .join(blobs, blobs.c.digest == BlobRow.digest))
    last = max((r.last_used for r in per_repo if r.last_used), default=None)
    return RepositoryUsage("*", int(n), sum(r.tags for r in per_repo), int(size),
                           int(referenced or 0), int(stored or 0),
                           sum(r.hits for r in per_repo), last)

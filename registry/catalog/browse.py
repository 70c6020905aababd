"""Read-only queries for browsing the catalog: what the web page lists and searches, which
other artifacts share an artifact's chunk blobs, and an artifact's latest events.

Every query is bounded by a limit, so a page costs the same on a catalog of any size.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import ColumnElement, and_, exists, func, or_, select
from sqlalchemy.orm import Session, aliased

from kvgraft.catalog.catalog import Catalog
from kvgraft.catalog.models import (
    ArtifactChunkRow,
    ArtifactRow,
    EventRow,
    LabelRow,
    ModelRow,
    RepositoryArtifactRow,
    TagRow,
)
from kvgraft.catalog.records import EventRecord, aware
from kvgraft.digest import Digest

MAX_LIMIT = 1000


@dataclass(frozen=True, slots=True)
class Search:
    """What to look for; empty fields match everything.

    `name`: a substring of the repository (or `repo-part:tag-prefix`), or a shell pattern
    with `*`/`?`. `label`: `key` or `key=value`. `model`: a substring of the model name, or
    a prefix of the model identity, architecture, tokenizer or weights digest.
    """

    name: str = ""
    label: str = ""
    model: str = ""
    repository: str | None = None  # exactly this repository


@dataclass(frozen=True, slots=True)
class Listing:
    """One (repository, artifact) pair: a tag, or `tag` None for an untagged artifact."""

    repository: str
    tag: str | None
    digest: Digest
    model_name: str
    model_identity: Digest
    token_count: int
    size: int
    created_at: datetime
    updated_at: datetime
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Sharing:
    """Chunks of one artifact whose blobs another artifact holds too."""

    digest: Digest
    chunks: tuple[int, ...]  # indices of the chunks of the artifact being looked at
    names: tuple[str, ...]  # `repository:tag` of the other artifact, or its repositories


def _like(text: str) -> str:
    """`text` as a LIKE pattern that matches it literally (escape character `\\`)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _name_clause(name: str) -> ColumnElement[bool]:
    repo, _, tag = name.partition(":")
    if any(ch in repo for ch in "*?"):
        repo_like = _like(repo).replace("*", "%").replace("?", "_")
    else:
        repo_like = f"%{_like(repo)}%"
    clause: ColumnElement[bool] = RepositoryArtifactRow.repository.like(repo_like,
                                                                        escape="\\")
    if tag:
        clause = and_(clause, TagRow.tag.like(f"{_like(tag)}%", escape="\\"))
    return clause


def _label_clause(label: str) -> ColumnElement[bool]:
    key, eq, value = label.partition("=")
    cond = [LabelRow.artifact_digest == ArtifactRow.digest,
            LabelRow.repository == RepositoryArtifactRow.repository, LabelRow.key == key.strip()]
    if eq:
        cond.append(LabelRow.value == value.strip())
    return exists().where(*cond)


def _model_clause(model: str) -> ColumnElement[bool]:
    model = model.strip()
    options = [ModelRow.name.like(f"%{_like(model)}%", escape="\\")]
    digest = model if model.startswith("sha256:") else f"sha256:{model}"
    if len(digest) > len("sha256:") + 3:
        prefix = f"{_like(digest)}%"
        options += [col.like(prefix, escape="\\") for col in (
            ModelRow.identity, ModelRow.architecture, ModelRow.tokenizer, ModelRow.weights)]
    return or_(*options)


def search(catalog: Catalog, query: Search, *, limit: int = 200,
           offset: int = 0) -> tuple[list[Listing], bool]:
    """Matching (repository, tag or untagged artifact) rows by repository then tag, and
    whether more rows follow."""
    limit = max(1, min(limit, MAX_LIMIT))
    q = (select(RepositoryArtifactRow.repository, TagRow.tag, ArtifactRow.digest,
                ModelRow.name, ModelRow.identity, ArtifactRow.token_count, ArtifactRow.size,
                ArtifactRow.created_at, TagRow.updated_at, RepositoryArtifactRow.created_at)
         .join(ArtifactRow, ArtifactRow.digest == RepositoryArtifactRow.artifact_digest)
         .join(ModelRow, ModelRow.id == ArtifactRow.model_id)
         .outerjoin(TagRow, and_(TagRow.repository == RepositoryArtifactRow.repository,
                                 TagRow.artifact_digest == ArtifactRow.digest)))
    if query.repository is not None:
        q = q.where(RepositoryArtifactRow.repository == query.repository)
    if query.name.strip():
        q = q.where(_name_clause(query.name.strip()))
    if query.label.strip():
        q = q.where(_label_clause(query.label.strip()))
    if query.model.strip():
        q = q.where(_model_clause(query.model))
    # Tagged rows first within a repository (SQLite sorts NULL first, PostgreSQL last: the
    # explicit IS NULL key makes both agree), then the newest untagged artifacts.
    q = (q.order_by(RepositoryArtifactRow.repository, TagRow.tag.is_(None), TagRow.tag,
                    ArtifactRow.created_at.desc(), ArtifactRow.digest)
         .offset(max(0, offset)).limit(limit + 1))
    with catalog._session() as s:
        rows = s.execute(q).all()
        more = len(rows) > limit
        rows = rows[:limit]
        digests = sorted({r[2] for r in rows})
        labels: dict[tuple[str, str], dict[str, str]] = {}
        for i in range(0, len(digests), 500):
            for lb in s.scalars(select(LabelRow).where(
                    LabelRow.artifact_digest.in_(digests[i:i + 500]))):
                labels.setdefault((lb.repository, lb.artifact_digest), {})[lb.key] = lb.value
    out = [Listing(repo, tag, Digest.parse(d), name, Digest.parse(identity), int(tokens),
                   int(size), aware(created), aware(tagged or added),
                   labels.get((repo, d), {}))
           for repo, tag, d, name, identity, tokens, size, created, tagged, added in rows]
    return out, more


def shared_chunks(catalog: Catalog, digest: Digest, *, limit: int = 50) -> tuple[
        list[Sharing], bool]:
    """The other artifacts holding blobs of `digest`'s chunks (most shared first) and
    whether more than `limit` do."""
    mine, theirs = aliased(ArtifactChunkRow), aliased(ArtifactChunkRow)
    pair = (mine.artifact_digest == str(digest), theirs.blob_digest == mine.blob_digest,
            theirs.artifact_digest != str(digest))
    with catalog._session() as s:
        ranked = s.execute(
            select(theirs.artifact_digest, func.count(func.distinct(mine.idx)).label("n"))
            .where(*pair).group_by(theirs.artifact_digest)
            .order_by(func.count(func.distinct(mine.idx)).desc(), theirs.artifact_digest)
            .limit(limit + 1)).all()
        more = len(ranked) > limit
        others = [d for d, _ in ranked[:limit]]
        if not others:
            return [], False
        chunks: dict[str, set[int]] = {}
        for other, idx in s.execute(select(theirs.artifact_digest, mine.idx).where(
                *pair, theirs.artifact_digest.in_(others))):
            chunks.setdefault(other, set()).add(int(idx))
        names = _names(s, others)
    return [Sharing(Digest.parse(d), tuple(sorted(chunks.get(d, ()))),
                    tuple(names.get(d, ()))) for d in others], more


def _names(s: Session, digests: Sequence[str]) -> dict[str, list[str]]:
    """`repository:tag` of each artifact, plus bare repositories where it has no tag."""
    names: dict[str, list[str]] = {}
    for t in s.scalars(select(TagRow).where(TagRow.artifact_digest.in_(digests))
                       .order_by(TagRow.repository, TagRow.tag)):
        names.setdefault(t.artifact_digest, []).append(f"{t.repository}:{t.tag}")
    for r in s.scalars(select(RepositoryArtifactRow).where(
            RepositoryArtifactRow.artifact_digest.in_(digests))
            .order_by(RepositoryArtifactRow.repository)):
        have = names.setdefault(r.artifact_digest, [])
        if not any(n.startswith(f"{r.repository}:") for n in have):
            have.append(r.repository)
    return names


def names_of(catalog: Catalog, digests: Sequence[Digest]) -> dict[Digest, tuple[str, ...]]:
    """How each artifact is known: its `repository:tag`s, or its repositories."""
    keys = [str(d) for d in digests]
    out: dict[Digest, tuple[str, ...]] = {}
    with catalog._session() as s:
        for i in range(0, len(keys), 500):
            for d, names in _names(s, keys[i:i + 500]).items():
                out[Digest.parse(d)] = tuple(names)
    return out


def parents_of(catalog: Catalog, digests: Sequence[Digest]) -> dict[Digest, tuple[Digest, ...]]:
    """The parents each manifest names, for the artifacts of `digests` in the catalog (a
    manifest too corrupt to read names none: the audit reports it)."""
    keys = [str(d) for d in digests]
    out: dict[Digest, tuple[Digest, ...]] = {}
    with catalog._session() as s:
        for i in range(0, len(keys), 500):
            for d, raw in s.execute(select(ArtifactRow.digest, ArtifactRow.manifest)
                                    .where(ArtifactRow.digest.in_(keys[i:i + 500]))):
                try:
                    parents = tuple(Digest.parse(p) for p in json.loads(raw)["parents"])
                except (ValueError, KeyError, TypeError, AttributeError):
                    parents = ()
                out[Digest.parse(d)] = parents
    return out


def recent_events(catalog: Catalog, digest: Digest, *,
                  limit: int = 100) -> tuple[list[EventRecord], int]:
    """The latest `limit` events about `digest`, newest first, and how many there are."""
    with catalog._session() as s:
        total = s.scalar(select(func.count()).select_from(EventRow)
                         .where(EventRow.digest == str(digest))) or 0
        rows = s.scalars(select(EventRow).where(EventRow.digest == str(digest))
                         .order_by(EventRow.id.desc()).limit(max(1, min(limit, MAX_LIMIT))))
        events = [EventRecord(
            action=e.action, actor=e.actor, host=e.host, outcome=e.outcome,
            repository=e.repository, tag=e.tag,
            digest=Digest.parse(e.digest) if e.digest else None,
            detail=json.loads(e.detail), at=aware(e.at), id=e.id) for e in rows]
    return events, int(total)

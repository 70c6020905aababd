"""Prefix-lookup queries over artifact_chunks.prefix_key (an indexed equality column).

Every query here is an index seek: no query reads rows in proportion to the catalog size.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import select, text

from kvgraft.catalog.catalog import Catalog
from kvgraft.catalog.models import (
    ArtifactChunkRow,
    ArtifactRow,
    ModelRow,
    RepositoryArtifactRow,
)
from kvgraft.catalog.records import stored_digest
from kvgraft.digest import Digest


def chunk_sizes(catalog: Catalog, identity_key: Digest) -> list[int]:
    """The distinct chunk sizes of the model's artifacts, most common first.

    The model row is found by its unique identity; its artifacts through the model_id
    index. Read once per lookup (a handful of values)."""
    with catalog._session() as s:
        model_id = s.scalar(select(ModelRow.id).where(ModelRow.identity == str(identity_key)))
        if model_id is None:
            return []
        # A skip scan: each step seeks the next larger size in (model_id, chunk_tokens).
        rows = s.execute(text(
            "WITH RECURSIVE sizes(c) AS ("
            " SELECT MIN(chunk_tokens) FROM artifacts WHERE model_id = :m"
            " UNION ALL"
            " SELECT (SELECT MIN(chunk_tokens) FROM artifacts"
            "         WHERE model_id = :m AND chunk_tokens > sizes.c)"
            " FROM sizes WHERE sizes.c IS NOT NULL)"
            " SELECT c FROM sizes WHERE c IS NOT NULL"), {"m": model_id}).all()
    return sorted(int(r[0]) for r in rows)


Within = Collection[str] | None  # repositories a match may come from; None: all of them


def repositories(catalog: Catalog) -> list[str]:
    """Every repository holding an artifact (what a caller's scopes are matched against)."""
    with catalog._session() as s:
        return list(s.scalars(select(RepositoryArtifactRow.repository).distinct()))


def _within(query: Any, within: Within) -> Any:
    """`query` narrowed to chunks of artifacts held in `within`: the filter is part of the
    lookup, so an artifact outside it neither answers nor hides one inside."""
    if within is None:
        return query
    return query.where(ArtifactChunkRow.artifact_digest.in_(
        select(RepositoryArtifactRow.artifact_digest)
        .where(RepositoryArtifactRow.repository.in_(sorted(within)))))


def has_prefix_key(catalog: Catalog, key: Digest, within: Within = None) -> bool:
    with catalog._session() as s:
        return s.scalar(_within(select(ArtifactChunkRow.idx).where(
            ArtifactChunkRow.prefix_key == str(key)), within).limit(1)) is not None


def deepest_prefix(catalog: Catalog, keys: Sequence[Digest], within: Within = None) -> int:
    """How many leading keys of a chain are in the catalog (0..len(keys)).

    A chain is prefix-closed (an artifact holding key c holds keys 0..c-1 too), so a
    binary search needs log2(len(keys)) single-row index seeks."""
    lo, hi = 0, len(keys)  # keys[:lo] are present; keys[hi:] are not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if has_prefix_key(catalog, keys[mid - 1], within):
            lo = mid
        else:
            hi = mid - 1
    return lo


def artifacts_with_key(catalog: Catalog, key: Digest, limit: int,
                       within: Within = None) -> list[tuple[Digest, int]]:
    """(artifact digest, token count) of up to `limit` artifacts whose chain holds `key`,
    newest first."""
    with catalog._session() as s:
        rows = s.execute(_within(
            select(ArtifactRow.digest, ArtifactRow.token_count)
            .join(ArtifactChunkRow, ArtifactChunkRow.artifact_digest == ArtifactRow.digest)
            .where(ArtifactChunkRow.prefix_key == str(key)), within)
            .order_by(ArtifactRow.created_at.desc(), ArtifactRow.digest)
            .limit(limit)).all()
    return [(stored_digest(d, "artifacts"), int(n)) for d, n in rows]


def artifacts_with_keys(catalog: Catalog, keys: Sequence[Digest], limit: int,
                        within: Within = None) -> list[tuple[Digest, Digest]]:
    """(artifact digest, the key it holds) of up to `limit` artifacts whose chain holds one
    of `keys`, newest first: one IN query, an index seek per key."""
    if not keys:
        return []
    with catalog._session() as s:
        rows = s.execute(_within(
            select(ArtifactRow.digest, ArtifactChunkRow.prefix_key)
            .join(ArtifactChunkRow, ArtifactChunkRow.artifact_digest == ArtifactRow.digest)
            .where(ArtifactChunkRow.prefix_key.in_([str(k) for k in keys])), within)
            .order_by(ArtifactRow.created_at.desc(), ArtifactRow.digest)
            .limit(limit)).all()
    return [(stored_digest(d, "artifacts"), stored_digest(k, "artifact_chunks"))
            for d, k in rows]

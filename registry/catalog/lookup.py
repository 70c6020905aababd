"""Prefix-lookup queries over artifact_chunks.prefix_key.

Every query here is an index seek: none reads rows in proportion to the catalog size, nor
to how many artifacts share a key. The index (prefix_key, created_at, artifact_digest)
hands out the artifacts holding a key newest first, read backwards from the key's end, so
a key thousands of artifacts share (a system prompt's) costs what a rare one does. (A
lookup narrowed to repositories reads past the newer holders outside them.)

A lookup runs its queries over one connection, without a transaction (`PrefixLookup`): a
checkout from the pool (with its liveness ping) and a BEGIN per query were most of a
lookup's time. On PostgreSQL it asks one query, and a second for the tail keys only when
that can find more: building statements and sending parameters cost the client more than
PostgreSQL took to answer (docs/deploy.md, "Catalog at scale").
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, TextClause, select, text

from kvgraft.catalog.models import ArtifactChunkRow, RepositoryArtifactRow
from kvgraft.catalog.reader import CatalogReader
from kvgraft.catalog.records import stored_digest
from kvgraft.digest import Digest

_C = ArtifactChunkRow.__table__.c
# A skip scan over (model_id, chunk_tokens): each step seeks the next larger size.
_SIZES_CTES = (
    "m(id) AS (SELECT id FROM models WHERE identity = :identity),"
    " sizes(c) AS ("
    " SELECT MIN(chunk_tokens) FROM artifacts WHERE model_id = (SELECT id FROM m)"
    " UNION ALL"
    " SELECT (SELECT MIN(chunk_tokens) FROM artifacts"
    "         WHERE model_id = (SELECT id FROM m) AND chunk_tokens > sizes.c)"
    " FROM sizes WHERE sizes.c IS NOT NULL)")
_SIZES = text(f"WITH RECURSIVE {_SIZES_CTES} SELECT c FROM sizes WHERE c IS NOT NULL")

# How many leading keys of a chain some artifact holds (the first key none holds ends the
# prefix), and the newest holders of the last of them, in one query. The keys go as one
# comma-separated string (a digest holds no comma), which costs the driver nothing to
# send; an array of strings it checks for quoting one by one. `{scope}` is empty, or the
# filter to artifacts of the lookup's repositories (`_SCOPE`): the filter is part of each
# probe, so an artifact outside them neither answers nor hides one inside.
_SCOPE = (" AND {c}.artifact_digest IN (SELECT ra.artifact_digest FROM repository_artifacts ra"
          " WHERE ra.repository = ANY(CAST(:repos AS varchar[])))")
_DEEPEST_CTES = (
    "k AS (SELECT key, n FROM unnest(CAST(string_to_array(:keys, ',') AS varchar[]))"
    "      WITH ORDINALITY AS k(key, n)),"
    " d AS (SELECT coalesce(min(k.n) - 1, :count) AS shared FROM k"
    "       WHERE NOT EXISTS (SELECT 1 FROM artifact_chunks c WHERE c.prefix_key = k.key"
    "{scope}))")
_DEEPEST_FROM = (
    " FROM d LEFT JOIN LATERAL ("
    "  SELECT c.artifact_digest FROM artifact_chunks c"
    "  WHERE c.prefix_key = (SELECT k.key FROM k WHERE k.n = d.shared){scope}"
    "  ORDER BY c.created_at DESC, c.artifact_digest DESC LIMIT :limit) h ON true")
# The newest artifacts holding any of the keys (a lookup's tail keys, up to c-1 of them).
_ANY_KEY = (
    "SELECT c.artifact_digest, c.prefix_key FROM artifact_chunks c"
    " WHERE c.prefix_key = ANY(CAST(string_to_array(:keys, ',') AS varchar[])){scope}"
    " ORDER BY c.created_at DESC, c.artifact_digest DESC LIMIT :limit")


def _scoped(template: str, scoped: bool) -> TextClause:
    return text(template.replace("{scope}", _SCOPE.format(c="c") if scoped else ""))


# [scoped]: the lookup's statements, without and with the repository filter
_DEEPEST_HOLDERS = [_scoped(f"WITH {_DEEPEST_CTES} SELECT d.shared, h.artifact_digest"
                            f"{_DEEPEST_FROM}", s) for s in (False, True)]
# The model's chunk sizes (rows 0, size, NULL) and, for one size whose keys the lookup
# sent, the deepest key and its holders (rows 1, shared, holder): a lookup's first query.
_SIZES_AND_DEEPEST = [_scoped(
    f"WITH RECURSIVE {_SIZES_CTES}, {_DEEPEST_CTES}"
    " SELECT 0, c, CAST(NULL AS varchar) FROM sizes WHERE c IS NOT NULL"
    f" UNION ALL SELECT 1, d.shared, h.artifact_digest{_DEEPEST_FROM}", s)
    for s in (False, True)]
_HOLDERS_OF_ANY = [_scoped(_ANY_KEY, s) for s in (False, True)]


Within = Collection[str] | None  # repositories a match may come from; None: all of them


def _within(query: Any, within: Within) -> Any:
    """`query` narrowed to chunks of artifacts held in `within`: the filter is part of the
    lookup, so an artifact outside it neither answers nor hides one inside."""
    if within is None:
        return query
    return query.where(_C.artifact_digest.in_(
        select(RepositoryArtifactRow.artifact_digest)
        .where(RepositoryArtifactRow.repository.in_(sorted(within)))))


def repositories(catalog: CatalogReader) -> list[str]:
    """Every repository holding an artifact (what a caller's scopes are matched against)."""
    with catalog._guard(), catalog.engine.connect() as conn:
        return list(conn.execute(
            select(RepositoryArtifactRow.repository).distinct()).scalars())


class PrefixLookup:
    """The queries of one prefix lookup, over one connection inside one transaction."""

    def __init__(self, conn: Connection, within: Within = None) -> None:
        self.conn = conn
        self.within = within

    def chunk_sizes(self, identity_key: Digest) -> list[int]:
        """The distinct chunk sizes of the model's artifacts, smallest first (one query:
        the model by its unique identity, its sizes through (model_id, chunk_tokens))."""
        rows = self.conn.execute(_SIZES, {"identity": str(identity_key)}).all()
        return sorted(int(r[0]) for r in rows)

    def has_prefix_key(self, key: Digest) -> bool:
        return self.conn.execute(_within(select(_C.idx).where(
            _C.prefix_key == str(key)), self.within).limit(1)).first() is not None

    def deepest_prefix(self, keys: Sequence[Digest]) -> int:
        """How many leading keys of a chain are in the catalog (0..len(keys)), where
        PostgreSQL's one-query forms do not answer: a chain being prefix-closed (an artifact
        holding key c holds keys 0..c-1 too), a binary search of log2(len(keys))
        single-row index seeks."""
        lo, hi = 0, len(keys)  # keys[:lo] are present; keys[hi:] are not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.has_prefix_key(keys[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def in_one_query(self) -> bool:
        """Whether `sizes_and_deepest` answers (PostgreSQL)."""
        return self.conn.dialect.name == "postgresql"

    def _params(self, **params: Any) -> dict[str, Any]:
        if self.within is not None:
            params["repos"] = sorted(self.within)
        return params

    def sizes_and_deepest(self, identity_key: Digest, keys: Sequence[Digest],
                          limit: int) -> tuple[list[int], int, list[Digest]]:
        """`chunk_sizes` and `deepest_holders` of the keys of one chunk size, in one query
        (only where `in_one_query`). The keys' size is a guess the sizes confirm or not."""
        rows = self.conn.execute(_SIZES_AND_DEEPEST[self.within is not None], self._params(
            identity=str(identity_key), keys=",".join(str(k) for k in keys),
            count=len(keys), limit=limit)).all()
        sizes = sorted(int(n) for part, n, _ in rows if part == 0)
        shared = next(int(n) for part, n, _ in rows if part == 1)
        return sizes, shared, [stored_digest(d, "artifact_chunks")
                               for part, _, d in rows if part == 1 and d is not None]

    def deepest_holders(self, keys: Sequence[Digest],
                        limit: int) -> tuple[int, list[Digest]]:
        """(how many leading keys of a chain are in the catalog, up to `limit` artifacts
        holding the last of them, newest first; none when no key is held). One query on
        PostgreSQL; elsewhere `deepest_prefix` then `artifacts_with_keys`."""
        if self.in_one_query and keys:
            rows = self.conn.execute(_DEEPEST_HOLDERS[self.within is not None], self._params(
                keys=",".join(str(k) for k in keys), count=len(keys), limit=limit)).all()
            return int(rows[0][0]), [stored_digest(d, "artifact_chunks")
                                     for _, d in rows if d is not None]
        shared = self.deepest_prefix(keys)
        if not shared:
            return 0, []
        return shared, [d for d, _ in self.artifacts_with_keys(keys[shared - 1:shared], limit)]

    def artifacts_with_keys(self, keys: Sequence[Digest],
                            limit: int) -> list[tuple[Digest, Digest]]:
        """(artifact digest, the key it holds) of up to `limit` artifacts whose chain holds
        one of `keys`, newest first: an index seek per key, the newest entries of each."""
        return [(d, stored_digest(k, "artifact_chunks"))
                for d, k in self.artifacts_with_key_texts([str(k) for k in keys], limit)]

    def artifacts_with_key_texts(self, keys: Sequence[str],
                                 limit: int) -> list[tuple[Digest, str]]:
        """`artifacts_with_keys` for keys in their stored form ("sha256:<hex>"), each
        answer's key as stored (one of `keys`)."""
        if not keys:
            return []
        postgres = self.conn.dialect.name == "postgresql"
        if postgres and len(keys) > 1:
            rows = self.conn.execute(_HOLDERS_OF_ANY[self.within is not None],
                                     self._params(keys=",".join(keys), limit=limit)).all()
            return [(stored_digest(d, "artifact_chunks"), k) for d, k in rows]
        where = _C.prefix_key == keys[0] if len(keys) == 1 else _C.prefix_key.in_(keys)
        rows = self.conn.execute(
            _within(select(_C.artifact_digest, _C.prefix_key).where(where), self.within)
            .order_by(_C.created_at.desc(), _C.artifact_digest.desc()).limit(limit)).all()
        return [(stored_digest(d, "artifact_chunks"), k) for d, k in rows]


@contextmanager
def prefix_lookup(catalog: CatalogReader, within: Within = None) -> Iterator[PrefixLookup]:
    # Each query its own snapshot, no BEGIN and COMMIT: a lookup only proposes candidates
    # (the match opens each one), so it needs no snapshot across its queries.
    with catalog._guard(), catalog.engine.connect() as conn:
        yield PrefixLookup(conn.execution_options(isolation_level="AUTOCOMMIT"), within)


def chunk_sizes(catalog: CatalogReader, identity_key: Digest) -> list[int]:
    with prefix_lookup(catalog) as q:
        return q.chunk_sizes(identity_key)


def has_prefix_key(catalog: CatalogReader, key: Digest, within: Within = None) -> bool:
    with prefix_lookup(catalog, within) as q:
        return q.has_prefix_key(key)


def artifacts_with_keys(catalog: CatalogReader, keys: Sequence[Digest], limit: int,
                        within: Within = None) -> list[tuple[Digest, Digest]]:
    with prefix_lookup(catalog, within) as q:
        return q.artifacts_with_keys(keys, limit)


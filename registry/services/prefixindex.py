"""Who knows which artifacts share a token prefix: the SQL catalog's prefix keys, or a
`kvgraft serve` answering for what its token may pull. Either hands the prefix match
(kvgraft.services.match) candidates; the match opens each through the policy.

Chunk prefix keys (kvgraft.formats.prefix) narrow it with indexed equality queries: for
each chunk size in use by the model, the query's chain keys are computed and a binary
search finds how many leading chunks some artifact shares. Past them, the keys a partial
last chunk of 1..c-1 query tokens would have find the grafts the query extends (one shorter
than a chunk included) in one IN query; a token comparison finishes it inside the next
chunk, over a bounded number of candidates.
"""

from __future__ import annotations

import fnmatch
import struct
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvgraft.digest import Digest
from kvgraft.identity.model import ModelIdentity

if TYPE_CHECKING:
    from kvgraft.catalog import Catalog
    from kvgraft.catalog.lookup import PrefixLookup
    from kvgraft.remote.http import HttpRemote


# A chunk size's prefix keys of the query, how many leading ones the catalog holds, and the
# newest holders of the last of those.
Deepest = tuple[list[Digest], int, list[Digest]]


@dataclass(frozen=True, slots=True)
class Candidate:
    digest: Digest
    covers: int  # leading query tokens it is known to cover
    chunk_tokens: int
    shared_chunks: int  # full chunks matched by prefix key alone
    exact: bool = False  # `covers` is the final length (else compare tokens past it)
    token_count: int | None = None  # when the index knows it
    references: tuple[str, ...] | None = None  # when the index knows them


@dataclass(frozen=True, slots=True)
class RepositoryScope:
    """The repositories a match may come from: names or shell patterns (fnmatch). The
    lookup itself is narrowed to them, so grafts elsewhere neither answer nor take the
    places of candidates inside."""

    patterns: tuple[str, ...]

    def __call__(self, repository: str) -> bool:
        return any(fnmatch.fnmatchcase(repository, p) for p in self.patterns)

    @property
    def names(self) -> frozenset[str] | None:
        """The repositories themselves when every pattern is a plain name (no listing of
        the catalog's repositories needed to match them), else None."""
        if any(ch in p for p in self.patterns for ch in "*?["):
            return None
        return frozenset(self.patterns)


class PrefixIndex(Protocol):
    def candidates(self, identity: ModelIdentity, ids: Sequence[int], limit: int,
                   scope: RepositoryScope | None = None) -> Iterator[Candidate]: ...


class CatalogPrefixIndex:
    """`within`: the repositories candidates may come from (a server answering one
    caller), every repository when None."""

    def __init__(self, catalog: Catalog, within: Collection[str] | None = None) -> None:
        self.catalog = catalog
        self.within = within

    def candidates(self, identity: ModelIdentity, ids: Sequence[int], limit: int,
                   scope: RepositoryScope | None = None) -> Iterator[Candidate]:
        from kvgraft.catalog.lookup import prefix_lookup, repositories
        from kvgraft.formats.chunks import DEFAULT_CHUNK_TOKENS
        from kvgraft.formats.prefix import prefix_keys

        within = self.within
        if scope is not None:
            if within is None and scope.names is not None:  # the usual case: one name
                within = scope.names
            else:
                within = frozenset(r for r in (repositories(self.catalog) if within is None
                                               else within) if scope(r))
            if not within:
                return
        query = struct.pack(f"<{len(ids)}q", *ids)
        found: list[Candidate] = []
        # Every query over one connection, released before the caller opens candidates.
        with prefix_lookup(self.catalog, within) as q:
            first: dict[int, Deepest] = {}
            if q.in_one_query:
                # The model's sizes and the deepest key of the usual size, in one round
                # trip: a model without that size only wasted a few index seeks.
                c = DEFAULT_CHUNK_TOKENS
                keys = prefix_keys(identity, query, c)
                sizes, shared, holders = q.sizes_and_deepest(identity.key,
                                                             keys[:len(ids) // c], limit)
                first[c] = (keys, shared, holders)
            else:
                sizes = q.chunk_sizes(identity.key)
            for c in sizes:
                shared, known = self._by_size(q, identity, query, len(ids), c, limit,
                                              first.get(c))
                found += [Candidate(digest, n, c, shared) for digest, n in known.items()]
        yield from found

    @staticmethod
    def _by_size(q: PrefixLookup, identity: ModelIdentity, query: bytes, n: int, c: int,
                 limit: int, asked: Deepest | None = None) -> tuple[int, dict[Digest, int]]:
        """(full chunks shared by key, {artifact: tokens it is known to cover}) for chunk
        size `c`. Artifacts holding the last shared full chunk cover at least those chunks
        (tokens compared later may extend it); an artifact whose partial last chunk's key
        is one of the query's tail keys covers exactly up to that key. `asked`: the keys,
        the deepest held and its holders, when the lookup's first query answered them."""
        from kvgraft.formats.prefix import prefix_keys, tail_key_hexes

        if asked is not None:
            keys, shared, holders = asked
        else:
            keys = prefix_keys(identity, query, c)
            shared, holders = q.deepest_holders(keys[:n // c], limit)
        found = dict.fromkeys(holders, shared * c)
        if shared and len(holders) < limit:
            # Every artifact a tail key would find holds keys[shared - 1] too (chains are
            # prefix-closed), so it is among these already, and the match compares its
            # tokens past the shared chunks: the tail keys' index seeks (up to c-1 of
            # them) are needed only when more artifacts share the prefix.
            return shared, found
        rest = min(n - shared * c, c - 1)  # a span of c tokens would be a full chunk
        tails = tail_key_hexes(identity, query, keys[shared - 1] if shared else None,
                               shared * c, rest)
        length_of = {f"sha256:{k}": shared * c + r for r, k in enumerate(tails, start=1)}
        for digest, key in q.artifacts_with_key_texts(list(length_of), limit):
            found[digest] = max(found.get(digest, 0), length_of[key])
        return shared, found


class ServerPrefixIndex:
    """The server holds the prefix index, and answers only what the token may pull: its
    one answer is final (the policy is still checked here, with this machine's keys)."""

    def __init__(self, remote: HttpRemote) -> None:
        self.remote = remote

    def candidates(self, identity: ModelIdentity, ids: Sequence[int], limit: int,
                   scope: RepositoryScope | None = None) -> Iterator[Candidate]:
        found = self.remote.match(identity, ids, scope.patterns if scope else None)
        if found is None:
            return
        yield Candidate(Digest.parse(found["digest"]), int(found["length"]),
                        int(found["chunk_tokens"]), int(found["shared_chunks"]), exact=True,
                        token_count=int(found["token_count"]),
                        references=tuple(str(r) for r in found["references"]))


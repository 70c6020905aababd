"""Prefix lookup across the registry: the artifact holding the longest cached prefix of a
token sequence under a given model.

Chunk prefix keys (registry.prefix) narrow it with indexed equality queries: for each chunk
size in use by the model, the query's chain keys are computed and a binary search finds
how many leading chunks some artifact shares. Past them, the keys a partial last chunk of
1..c-1 query tokens would have find the grafts the query extends (one shorter than a chunk
included) in one IN query; a token comparison finishes it inside the next chunk, over a
bounded number of candidates.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgraft.catalog import Catalog
from kvgraft.catalog.lookup import (
    artifacts_with_key,
    artifacts_with_keys,
    chunk_sizes,
    deepest_prefix,
)
from kvgraft.client import OpenedArtifact, Registry
from kvgraft.digest import Digest
from kvgraft.formats.prefix import prefix_keys, tail_keys
from kvgraft.identity.model import ModelIdentity

MAX_CANDIDATES = 32  # artifacts whose tokens are compared past the last shared chunk


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    digest: Digest
    length: int  # leading query tokens the artifact's cache covers
    token_count: int  # tokens the artifact holds
    chunk_tokens: int
    shared_chunks: int  # full chunks matched by prefix key alone
    references: tuple[str, ...] = ()  # repository:tag names pointing at the artifact

    def to_json(self) -> dict[str, Any]:
        return {"digest": str(self.digest), "length": self.length,
                "token_count": self.token_count, "chunk_tokens": self.chunk_tokens,
                "shared_chunks": self.shared_chunks, "references": list(self.references)}


def _lcp(a: Sequence[int], b: Sequence[int], start: int) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _tokens(opened: OpenedArtifact) -> tuple[int, ...]:
    data, _ = opened.fetcher.get(opened.manifest.tokens)
    view = memoryview(data)
    return struct.unpack(f"<{view.nbytes // 8}q", view)


def _candidates(catalog: Catalog, identity: ModelIdentity, query: bytes, n: int, c: int,
                limit: int) -> tuple[int, dict[Digest, int]]:
    """(full chunks shared by key, {artifact: tokens it is known to cover}) for chunk
    size `c`. Artifacts holding the last shared full chunk cover at least those chunks
    (tokens compared later may extend it); an artifact whose partial last chunk's key is
    one of the query's tail keys covers exactly up to that key."""
    keys = prefix_keys(identity, query, c)
    full = n // c  # the last key covers a partial span unless this divides
    shared = deepest_prefix(catalog, keys[:full])
    found: dict[Digest, int] = {}
    if shared:
        for digest, _ in artifacts_with_key(catalog, keys[shared - 1], limit):
            found[digest] = shared * c
    rest = min(n - shared * c, c - 1)  # a span of c tokens would be a full chunk
    tails = tail_keys(identity, query, keys[shared - 1] if shared else None, shared * c, rest)
    length_of = {k: shared * c + r for r, k in enumerate(tails, start=1)}
    for digest, key in artifacts_with_keys(catalog, tails, limit):
        found[digest] = max(found.get(digest, 0), length_of[key])
    return shared, found


def match(registry: Registry, identity: ModelIdentity, token_ids: Sequence[int], *,
          max_candidates: int = MAX_CANDIDATES, require_signed_by: Sequence[str] = (),
          require_verified: bool = False) -> PrefixMatch | None:
    """The artifact with the longest prefix of `token_ids` cached for `identity` (None if
    no artifact shares even one token). Ties go to the newest artifact.

    Only artifacts the policy accepts are answered (each candidate is opened through
    `Registry.open`, `require_signed_by` and `require_verified` adding to the policy of
    config.toml); when every artifact holding a prefix is refused, the refusal is raised
    (PolicyRefused, exit 4) rather than answering nothing."""
    from kvgraft.provenance import PolicyRefused

    ids = [int(t) for t in token_ids]
    if not ids:
        return None
    if registry.http is not None:
        return _match_over_http(registry, identity, ids, require_signed_by, require_verified)
    catalog = registry.catalog
    query = struct.pack(f"<{len(ids)}q", *ids)
    best: PrefixMatch | None = None
    refused: PolicyRefused | None = None
    for c in chunk_sizes(catalog, identity.key):
        shared, found = _candidates(catalog, identity, query, len(ids), c, max_candidates)
        for digest, known in found.items():
            try:
                opened = registry.open(digest, require_signed_by=require_signed_by,
                                       require_verified=require_verified, model=identity,
                                       action="match")
            except PolicyRefused as e:
                refused = refused or e
                continue
            length = max(known, _lcp(_tokens(opened), ids, shared * c))
            if length and (best is None or length > best.length):
                best = PrefixMatch(digest, length, opened.manifest.token_count, c, shared)
    if best is None:
        if refused is not None:
            raise refused
        return None
    tags = registry.catalog.artifact(best.digest).tags
    return dataclasses.replace(best, references=tuple(f"{t.repository}:{t.tag}" for t in tags))


def _match_over_http(registry: Registry, identity: ModelIdentity, ids: list[int],
                     require_signed_by: Sequence[str], require_verified: bool,
                     ) -> PrefixMatch | None:
    """Through a kvgraft server, the server answers the lookup (it holds the prefix index,
    and answers only what the token may pull); the policy is checked here, with this
    machine's keys and config, on the artifact it found."""
    assert registry.http is not None
    found = registry.http.match(identity, ids)
    if found is None:
        return None
    result = PrefixMatch(Digest.parse(found["digest"]), int(found["length"]),
                         int(found["token_count"]), int(found["chunk_tokens"]),
                         int(found["shared_chunks"]), tuple(found["references"]))
    registry.open(result.digest, require_signed_by=require_signed_by,
                  require_verified=require_verified, model=identity, action="match")
    return result

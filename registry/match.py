"""Prefix lookup across the registry: the artifact holding the longest cached prefix of a
token sequence under a given model.

Chunk prefix keys (registry.prefix) narrow it with indexed equality queries: for each chunk
size in use by the model, the query's chain keys are computed and a binary search finds
how many leading chunks some artifact shares. A token comparison then finishes it inside
the next, partial chunk, over a bounded number of candidates.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgraft.catalog.lookup import artifacts_with_key, chunk_sizes, deepest_prefix
from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.identity import ModelIdentity
from kvgraft.prefix import prefix_keys
from kvgraft.pull import Fetcher

MAX_CANDIDATES = 32  # artifacts whose tokens are compared past the last shared chunk


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    digest: Digest
    length: int  # leading query tokens the artifact's cache covers
    token_count: int  # tokens the artifact holds
    chunk_tokens: int
    shared_chunks: int  # full chunks matched by prefix key alone

    def to_json(self) -> dict[str, Any]:
        return {"digest": str(self.digest), "length": self.length,
                "token_count": self.token_count, "chunk_tokens": self.chunk_tokens,
                "shared_chunks": self.shared_chunks}


def _lcp(a: Sequence[int], b: Sequence[int], start: int) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _tokens(registry: Registry, digest: Digest) -> tuple[int, ...]:
    manifest = registry.manifest(digest)
    store = None if registry.config.offline else registry.store
    data, _ = Fetcher(store, registry.cache).get(manifest.tokens)
    view = memoryview(data)
    return struct.unpack(f"<{view.nbytes // 8}q", view)


def match(registry: Registry, identity: ModelIdentity, token_ids: Sequence[int], *,
          max_candidates: int = MAX_CANDIDATES) -> PrefixMatch | None:
    """The artifact with the longest prefix of `token_ids` cached for `identity` (None if
    no artifact shares even one token). Ties go to the newest artifact."""
    ids = [int(t) for t in token_ids]
    if not ids:
        return None
    catalog = registry.catalog
    query = struct.pack(f"<{len(ids)}q", *ids)
    best: PrefixMatch | None = None
    for c in chunk_sizes(catalog, identity.key):
        keys = prefix_keys(identity, query, c)
        full = len(ids) // c  # the last key covers a partial span unless this divides
        shared = deepest_prefix(catalog, keys[:full])
        # Candidates hold the last shared chunk; with none shared, an artifact shorter than
        # one chunk can still equal the whole query (its only chunk key is the query's).
        if shared:
            candidates = artifacts_with_key(catalog, keys[shared - 1], max_candidates)
        elif full == 0:
            candidates = artifacts_with_key(catalog, keys[0], max_candidates)
        else:
            candidates = []
        for digest, count in candidates:
            length = _lcp(_tokens(registry, digest), ids, shared * c)
            if length and (best is None or length > best.length):
                best = PrefixMatch(digest, length, count, c, shared)
    return best

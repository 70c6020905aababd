"""Prefix lookup across the registry: the artifact holding the longest cached prefix of a
token sequence under a given model. The candidates come from the backends' prefix index
(kvgraft.services.prefixindex); each is opened through the policy before it is answered."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvgraft.digest import Digest
from kvgraft.identity.model import ModelIdentity

if TYPE_CHECKING:
    from kvgraft.services.backends import Backends
    from kvgraft.services.prefixindex import Candidate, PrefixIndex, RepositoryScope
    from kvgraft.services.transfers import OpenedArtifact

MAX_CANDIDATES = 32  # artifacts whose tokens are compared past the last shared chunk


class Opener(Protocol):
    """What a match needs of a registry: its backends, and the one open-for-use path."""

    @property
    def backends(self) -> Backends: ...

    def open(self, ref: Digest, *, require_signed_by: Sequence[str] = (),
             require_verified: bool = False, model: ModelIdentity | None = None,
             action: str = "load") -> OpenedArtifact: ...


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


def _length(c: Candidate, opened: OpenedArtifact, ids: Sequence[int]) -> int:
    if c.exact:
        return c.covers
    return max(c.covers, _lcp(_tokens(opened), ids, c.shared_chunks * c.chunk_tokens))


def _references(registry: Opener, c: Candidate) -> tuple[str, ...]:
    if c.references is not None:
        return c.references
    tags = registry.backends.catalog.artifact(c.digest).tags
    return tuple(f"{t.repository}:{t.tag}" for t in tags)


def _repositories(registry: Opener, c: Candidate) -> tuple[str, ...]:
    """The repositories an artifact was pushed into (tagged there or not: a tag moved to
    another artifact leaves it in the repository)."""
    if c.references is not None:  # a server's answer: what the token may see
        return tuple(r.rsplit(":", 1)[0] for r in c.references)
    return registry.backends.catalog.artifact(c.digest).repositories


def match(registry: Opener, identity: ModelIdentity, token_ids: Sequence[int], *,
          max_candidates: int = MAX_CANDIDATES, require_signed_by: Sequence[str] = (),
          require_verified: bool = False, index: PrefixIndex | None = None,
          repositories: RepositoryScope | None = None) -> PrefixMatch | None:
    """The artifact with the longest prefix of `token_ids` cached for `identity` (None if
    no artifact shares even one token). Ties go to the newest artifact.

    Only artifacts the policy accepts are answered (each candidate is opened through
    `Registry.open`, `require_signed_by` and `require_verified` adding to the policy of
    config.toml); when every artifact holding a prefix is refused, the refusal is raised
    (PolicyRefused, exit 4) rather than answering nothing. `index`: where candidates come
    from (the backends' prefix index by default; a server narrows it to what its caller
    may read). With `repositories`, only artifacts pushed into a repository it accepts are
    candidates: the lookup is narrowed to them."""
    from kvgraft.provenance import PolicyRefused

    ids = [int(t) for t in token_ids]
    if not ids:
        return None
    best: tuple[PrefixMatch, Candidate] | None = None
    refused: PolicyRefused | None = None
    index = index or registry.backends.prefix_index()
    for c in index.candidates(identity, ids, max_candidates, repositories):
        if repositories is not None and not any(  # held there when the lookup ran
                repositories(r) for r in _repositories(registry, c)):
            continue
        try:
            opened = registry.open(c.digest, require_signed_by=require_signed_by,
                                   require_verified=require_verified, model=identity,
                                   action="match")
        except PolicyRefused as e:
            refused = refused or e
            continue
        length = _length(c, opened, ids)
        if length and (best is None or length > best[0].length):
            best = (PrefixMatch(c.digest, length, opened.manifest.token_count,
                                c.chunk_tokens, c.shared_chunks), c)
    if best is None:
        if refused is not None:
            raise refused
        return None
    found, c = best
    return dataclasses.replace(found, references=_references(registry, c))

"""What the web page shows about one artifact, gathered read-only from a Registry.

Signatures and attestations are re-verified on every view against the server's trust
store (fail closed: a trust store that cannot be read trusts no one, and the page says so).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgraft.catalog import ArtifactRecord, EventRecord, TagRecord
from kvgraft.catalog.browse import Sharing, recent_events, shared_chunks
from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, NotFound
from kvgraft.formats.manifest import Manifest
from kvgraft.provenance import (
    FIDELITY,
    PROVENANCE,
    AttestationStatus,
    PublicKey,
    provenance_statement,
)
from kvgraft.provenance.audit import origin
from kvgraft.provenance.policy import assess_all
from kvgraft.provenance.statement import fidelity_identity
from kvgraft.server.context import attestation_homes, server_catalog
from kvgraft.server.lineage import Graph, build, repository_of, restrict

EVENTS_SHOWN = 100


@dataclass(frozen=True, slots=True)
class ChunkRow:
    index: int
    start: int
    end: int
    digest: Digest
    size: int
    stored_size: int | None
    codec: str | None
    shared_with: int  # how many of the listed other artifacts hold this chunk's blob


@dataclass(frozen=True, slots=True)
class SharingView:
    sharing: Sharing
    bytes: int  # decoded bytes of the shared chunks
    runs: tuple[tuple[float, float], ...]  # (left, width) in % of the chunk axis

    @classmethod
    def of(cls, sharing: Sharing, sizes: dict[int, int], total: int) -> SharingView:
        runs: list[tuple[int, int]] = []
        for i in sharing.chunks:  # sorted: consecutive chunks become one run
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        scale = 100 / max(total, 1)
        return cls(sharing, sum(sizes.get(i, 0) for i in sharing.chunks),
                   tuple((a * scale, (b - a) * scale) for a, b in runs))


@dataclass(frozen=True, slots=True)
class AttestationView:
    status: AttestationStatus
    signer_names: tuple[str, ...]  # names the trust store gives the verified signers

    @property
    def claim(self) -> str:
        """What the statement says, in a few words."""
        st = self.status.statement
        if st is None:
            return "unreadable statement"
        if st.predicate_type == FIDELITY:
            outcome = "passed" if st.predicate.get("passed") is True else "failed"
            try:
                model = fidelity_identity(st).key.short
            except (IntegrityError, KeyError, TypeError, ValueError):
                model = "an unreadable model identity"
            return f"fidelity check {outcome} on model {model}"
        if st.predicate_type == PROVENANCE:
            return "provenance of this graft"
        return st.predicate_type

    @property
    def verdict(self) -> str:
        s = self.status
        if not s.ok:
            return "failed"
        return "verified" if s.signed else "unsigned"


@dataclass(frozen=True, slots=True)
class ArtifactView:
    record: ArtifactRecord  # tags and repositories: only those the viewer may read
    manifest: Manifest
    chunks: tuple[ChunkRow, ...]
    sharing: tuple[SharingView, ...]
    sharing_more: bool
    lineage: Graph
    provenance: dict[str, Any]  # the kvgraft provenance statement, as JSON
    attestations: tuple[AttestationView, ...]
    trust_problem: str | None
    events: tuple[EventRecord, ...]  # the latest, newest first
    events_more: bool  # older events exist beyond those

    @property
    def digest(self) -> Digest:
        return self.record.digest

    def pretty(self, value: Any) -> str:
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


def _origin_events(registry: Registry, digest: Digest,
                   visible: Callable[[str], bool]) -> list[EventRecord]:
    """The first push and copy of `digest` into a repository the viewer may read: who
    first pushed the same bytes elsewhere (actor, host) is another tenant's business."""
    firsts = []
    for action in ("push", "copy"):
        events = server_catalog(registry).events(digest=digest, action=action,
                                                 limit=1 if visible is everything else None)
        firsts += [e for e in events if e.repository is not None and visible(e.repository)][:1]
    return sorted(firsts, key=lambda e: e.id or 0)


def _trusted(registry: Registry) -> tuple[dict[str, PublicKey], str | None]:
    try:
        return registry.keyring.trusted(), None
    except IntegrityError as e:
        return {}, e.message


class NotVisible(NotFound):
    """An artifact in no repository the viewer may read."""


def everything(repository: str) -> bool:
    return True


def _visible_sharing(sharing: list[Sharing], visible: Callable[[str], bool]) -> list[Sharing]:
    out = []
    for s in sharing:
        names = tuple(n for n in s.names if visible(repository_of(n)))
        if names:  # that a graft elsewhere holds the same KV is not the viewer's to know
            out.append(dataclasses.replace(s, names=names))
    return out


def artifact_view(registry: Registry, digest: Digest,
                  visible: Callable[[str], bool] = everything) -> ArtifactView:
    """Everything the page shows about `digest`, as a viewer who may read the repositories
    `visible` accepts sees it; NotFound unless one of the artifact's repositories is."""
    catalog = server_catalog(registry)
    record = catalog.artifact(digest)
    repos = tuple(r for r in record.repositories if visible(r))
    if not repos:
        raise NotVisible(f"artifact {digest} is not in the catalog")
    tags: tuple[TagRecord, ...] = tuple(t for t in record.tags if visible(t.repository))
    labels = {r: v for r, v in record.repository_labels.items() if visible(r)}
    record = dataclasses.replace(record, repositories=repos, tags=tags, repository_labels=labels,
                                 labels={k: v for r in sorted(labels, reverse=True)
                                         for k, v in labels[r].items()})
    manifest = Manifest.parse(record.manifest, digest)  # hashes to `digest` or raises
    found, more = shared_chunks(catalog, digest)
    sharing = _visible_sharing(found, visible)
    holders: dict[int, int] = {}
    for s in sharing:
        for i in s.chunks:
            holders[i] = holders.get(i, 0) + 1
    blobs = catalog.blob_records(c.digest for c in manifest.chunks)
    chunks = tuple(ChunkRow(c.index, c.start, c.end, c.digest, c.size,
                            blobs[c.digest].stored_size if c.digest in blobs else None,
                            blobs[c.digest].codec if c.digest in blobs else None,
                            holders.get(c.index, 0)) for c in manifest.chunks)
    first = origin(_origin_events(registry, digest, visible))
    statement = provenance_statement(manifest, first, name=repos[0])
    trusted, trust_problem = _trusted(registry)
    names = {k.keyid: k.name for k in trusted.values() if k.name}
    if trust_problem is None:
        names.update({i.keyid: i.name for i in registry.keyring.listing() if i.name})
    homes = attestation_homes(catalog, digest)
    attestations = tuple(
        AttestationView(s, tuple(names.get(k, k[:16]) for k in s.signers))
        for s in assess_all(catalog, digest, trusted)
        if visible is everything or any(visible(r) for r in homes.get(s.id or 0, ())))
    events, total = recent_events(catalog, digest, limit=EVENTS_SHOWN)
    shown = tuple(e for e in events if visible is everything
                  or (e.repository is not None and visible(e.repository)))
    graph = restrict(build(catalog, digest, manifest.parents), visible)
    sizes = {c.index: c.size for c in manifest.chunks}
    shared = tuple(SharingView.of(s, sizes, len(manifest.chunks)) for s in sharing)
    return ArtifactView(record, manifest, chunks, shared, more, graph,
                        statement.to_json(), attestations, trust_problem, shown,
                        total > len(events))

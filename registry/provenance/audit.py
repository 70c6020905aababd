"""The audit report of one artifact: everything kvgraft knows about where it came from,
who vouched for it since, and whether every byte and record still checks out.

Nothing is taken from a cache: the manifest is read from the catalog and must hash to the
digest, every blob is re-read from the store and re-hashed, every attestation and
signature is re-verified against the trust store, and the whole event log's hash chain is
re-checked (a row deleted anywhere may have been about this artifact).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgraft.blobstore.base import BlobStore
from kvgraft.catalog import ArtifactRecord, EventRecord
from kvgraft.catalog.api import CatalogAPI
from kvgraft.catalog.events import ChainReport
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, NotFound
from kvgraft.formats.manifest import Manifest
from kvgraft.provenance.keys import PublicKey
from kvgraft.provenance.policy import AttestationStatus, assess_all
from kvgraft.provenance.statement import Origin, Statement, provenance_statement
from kvgraft.transfer.verify import VerifyReport, verify_artifact

MAX_DEPTH = 64  # lineage deeper than this is cut (and said so), not followed forever


@dataclass(frozen=True, slots=True)
class LineageNode:
    digest: Digest
    present: bool
    problem: str | None = None
    parents: tuple[LineageNode, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"digest": str(self.digest), "present": self.present, "problem": self.problem,
                "parents": [p.to_json() for p in self.parents]}

    def problems(self) -> list[str]:
        own = [f"lineage: {self.problem}"] if self.problem else []
        return own + [q for p in self.parents for q in p.problems()]


@dataclass(frozen=True, slots=True)
class AuditReport:
    digest: Digest
    record: ArtifactRecord
    manifest: Manifest | None
    manifest_problem: str | None
    provenance: Statement | None
    parents: tuple[LineageNode, ...]
    children: tuple[Digest, ...]
    attestations: tuple[AttestationStatus, ...]
    blobs: VerifyReport | None
    events: tuple[EventRecord, ...]
    chain: ChainReport
    failures: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "digest": str(self.digest), "ok": self.ok, "failures": list(self.failures),
            "tags": [f"{t.repository}:{t.tag}" for t in self.record.tags],
            "repositories": list(self.record.repositories),
            "manifest": None if m is None else {
                "token_count": m.token_count, "chunk_tokens": m.chunk_tokens,
                "chunks": len(m.chunks), "layers": len(m.layers), "size": m.size,
                "stored_size": self.record.stored_size,
                "file": {"digest": str(m.file_digest), "size": m.file_size}},
            "manifest_problem": self.manifest_problem,
            "model": None if m is None else {**m.model.to_json(), "name": m.model_name},
            "provenance": None if self.provenance is None else self.provenance.to_json(),
            "lineage": {"parents": [p.to_json() for p in self.parents],
                        "children": [str(c) for c in self.children]},
            "attestations": [a.to_json() for a in self.attestations],
            "blobs": None if self.blobs is None else {
                "ok": self.blobs.ok, "checked": self.blobs.checked,
                "checked_bytes": self.blobs.checked_bytes,
                "bad": [{"digest": str(b.digest), "reason": b.reason}
                        for b in self.blobs.bad]},
            "events": [_event_json(e) for e in self.events],
            "event_chain": self.chain.to_json(),
        }


def _event_json(e: EventRecord) -> dict[str, Any]:
    return {"id": e.id, "at": e.at.isoformat() if e.at else None, "actor": e.actor,
            "host": e.host, "action": e.action, "repository": e.repository, "tag": e.tag,
            "digest": str(e.digest) if e.digest else None, "outcome": e.outcome,
            "detail": dict(e.detail)}


def _manifest(catalog: CatalogAPI, digest: Digest) -> tuple[Manifest | None, str | None]:
    try:
        return Manifest.parse(catalog.artifact(digest).manifest, digest), None
    except NotFound:
        return None, f"{digest} is not in the catalog"
    except IntegrityError as e:
        return None, f"stored manifest of {digest} is corrupt: {e.message}"


def lineage(catalog: CatalogAPI, parents: tuple[Digest, ...], depth: int = 0,
            seen: frozenset[Digest] = frozenset()) -> tuple[LineageNode, ...]:
    nodes = []
    for p in parents:
        if p in seen or depth >= MAX_DEPTH:
            nodes.append(LineageNode(p, True, f"lineage of {p} not followed further "
                                              f"(cycle or deeper than {MAX_DEPTH})"))
            continue
        manifest, problem = _manifest(catalog, p)
        if manifest is None:
            nodes.append(LineageNode(p, catalog.has_artifact(p), f"parent: {problem}"))
            continue
        nodes.append(LineageNode(p, True, None, lineage(catalog, manifest.parents,
                                                        depth + 1, seen | {p})))
    return tuple(nodes)


def origin(events: list[EventRecord]) -> Origin | None:
    """Who first pushed (or copied in) the artifact, from its events."""
    for e in events:
        if e.action in ("push", "copy") and e.outcome == "ok" and e.at is not None:
            return Origin(e.actor, e.host, e.at, e.repository, e.tag)
    return None


def audit(catalog: CatalogAPI, store: BlobStore, digest: Digest,
          trusted: Mapping[str, PublicKey], *, workers: int | None = None) -> AuditReport:
    record = catalog.artifact(digest)
    failures: list[str] = []
    manifest, manifest_problem = _manifest(catalog, digest)
    if manifest_problem:
        failures.append(f"manifest: {manifest_problem}")
    events = catalog.events(digest=digest)
    provenance = parents = blobs = None
    if manifest is not None:
        provenance = provenance_statement(manifest, origin(events))
        parents = lineage(catalog, manifest.parents, 0, frozenset({digest}))
        failures += [q for p in parents for q in p.problems()]
        records = catalog.blob_records(b.digest for b in manifest.blobs())
        blobs = verify_artifact(manifest, store, records, workers=workers)
        failures += [f"blob {b.digest}: {b.reason}" for b in blobs.bad]
    statuses = assess_all(catalog, digest, trusted)
    failures += [f"attestation {s.id} ({s.predicate_type}): {'; '.join(s.problems)}"
                 for s in statuses if not s.ok]
    chain = catalog.event_chain()
    failures += [f"event log: {p.message}" for p in chain.problems]
    failures += [f"event log: {p}" for p in catalog.event_trigger_problems()]
    return AuditReport(digest, record, manifest, manifest_problem, provenance,
                       parents or (), tuple(catalog.children(digest)), tuple(statuses), blobs,
                       tuple(events), chain, tuple(failures))

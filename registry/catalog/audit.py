"""The event log's hash chain, and the queries audit, lineage and gc need.

Each event row carries `seq` (1, 2, 3, … with no holes), `prev_hash` (the previous event's
`hash`, or GENESIS for the first) and `hash`, the SHA-256 of the canonical JSON of every
field the row holds plus `seq` and `prev_hash`. A row deleted behind the library's back
leaves a hole in `seq` and a successor whose `prev_hash` names nothing; an edited row no
longer hashes to its `hash`. What a chain cannot show is the newest rows cut off together
(nothing follows them): `ChainReport.head` gives the (seq, hash) to record elsewhere, and a
later audit that finds the chain shorter than a recorded head has found that too.

Appending reads the head and inserts after it, so writers must not interleave: SQLite
writers already hold the database's write lock (BEGIN IMMEDIATE); on PostgreSQL the append
takes a transaction-scoped advisory lock first, held until the transaction ends. Events
are the last write of every transaction that writes one, so the lock is held briefly and
never while waiting for another lock. The unique index on `seq` turns any writer that
slipped past the lock into an error rather than a fork.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, exists, insert, select, text
from sqlalchemy.orm import Session

from kvgraft.catalog.models import (
    ArtifactBlobRow,
    ArtifactRow,
    AttestationRow,
    BlobDeletionRow,
    BlobRow,
    EventRow,
    OciBlobLinkRow,
    TagRow,
)
from kvgraft.catalog.records import BlobRecord, EventRecord, aware
from kvgraft.digest import Digest
from kvgraft.identity import canonical_json

GENESIS = "sha256:" + "0" * 64
# Any constant distinct from the schema-upgrade lock (kvgraft.catalog.schema).
CHAIN_LOCK = 7352918


def _stamp(at: datetime) -> str:
    at = at if at.tzinfo else at.replace(tzinfo=UTC)  # SQLite returns naive UTC
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_hash(seq: int, prev: str, at: datetime, fields: Mapping[str, Any]) -> str:
    """The chain hash of one event; `fields` holds the row's columns as stored (detail is
    its canonical JSON text). Frozen: migrations/versions/0002 computes the same."""
    body = {"v": 1, "seq": seq, "prev": prev, "at": _stamp(at),
            **{k: fields[k] for k in ("actor", "host", "action", "repository", "tag",
                                      "digest", "outcome", "detail")}}
    return str(Digest.of(canonical_json(body)))


def _columns(row: EventRow) -> dict[str, Any]:
    return {"actor": row.actor, "host": row.host, "action": row.action,
            "repository": row.repository, "tag": row.tag, "digest": row.digest,
            "outcome": row.outcome, "detail": row.detail}


def append_event(s: Session, e: EventRecord, now: datetime) -> None:
    """Insert `e` as the next link of the chain, inside the caller's transaction."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": CHAIN_LOCK})
    head = s.execute(select(EventRow.seq, EventRow.hash)
                     .order_by(EventRow.seq.desc()).limit(1)).first()
    seq, prev = (head[0] + 1, head[1]) if head is not None else (1, GENESIS)
    row = EventRow(at=now, actor=e.actor, host=e.host, action=e.action,
                   repository=e.repository, tag=e.tag,
                   digest=str(e.digest) if e.digest else None, outcome=e.outcome,
                   detail=canonical_json(dict(e.detail)).decode(), seq=seq, prev_hash=prev)
    row.hash = event_hash(seq, prev, now, _columns(row))
    s.add(row)
    s.flush()


@dataclass(frozen=True, slots=True)
class ChainLink:
    """One event row as the chain sees it."""

    id: int
    seq: int
    prev_hash: str
    hash: str
    computed: str  # what the row's content hashes to now


@dataclass(frozen=True, slots=True)
class ChainProblem:
    seq: int | None
    kind: str  # "missing", "edited", "broken-link"
    message: str


@dataclass(frozen=True, slots=True)
class ChainReport:
    events: int
    head: tuple[int, str] | None  # (seq, hash) of the newest event
    problems: tuple[ChainProblem, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "events": self.events,
                "head": {"seq": self.head[0], "hash": self.head[1]} if self.head else None,
                "problems": [{"seq": p.seq, "kind": p.kind, "message": p.message}
                             for p in self.problems]}


def read_chain(s: Session) -> list[ChainLink]:
    return [ChainLink(r.id, r.seq, r.prev_hash, r.hash,
                      event_hash(r.seq, r.prev_hash, r.at, _columns(r)))
            for r in s.scalars(select(EventRow).order_by(EventRow.seq))]


def check_chain(links: Iterable[ChainLink]) -> ChainReport:
    """Every way the stored chain disagrees with itself, in chain order."""
    problems: list[ChainProblem] = []
    expected_seq, prev = 1, GENESIS
    count, head = 0, None
    for link in links:
        count += 1
        if link.seq != expected_seq:
            lo, hi = expected_seq, link.seq - 1
            span = f"event {lo}" if lo == hi else f"events {lo}-{hi}"
            problems.append(ChainProblem(lo, "missing",
                                         f"{span} missing from the event log (deleted?)"))
        elif link.prev_hash != prev:
            problems.append(ChainProblem(link.seq, "broken-link",
                                         f"event {link.seq} does not follow event "
                                         f"{link.seq - 1} (previous hash differs)"))
        if link.computed != link.hash:
            problems.append(ChainProblem(link.seq, "edited",
                                         f"event {link.seq} was changed after it was "
                                         f"written (its content no longer hashes to "
                                         f"its recorded hash)"))
        expected_seq, prev, head = link.seq + 1, link.hash, (link.seq, link.hash)
    return ChainReport(count, head, tuple(problems))


# --- lineage and attestations ----------------------------------------------------------

def _parents(raw: str) -> tuple[Digest, ...]:
    try:
        parents = json.loads(raw).get("parents", [])
        return tuple(Digest.parse(p) for p in parents)
    except (ValueError, AttributeError, TypeError):
        return ()  # a corrupt manifest: audit reports it when it reads that artifact


def children(s: Session, digest: Digest) -> list[Digest]:
    # No parents table: manifests name their parents, and an artifact digest appears in
    # another manifest only there, so a LIKE narrows and the parse decides.
    rows = s.execute(select(ArtifactRow.digest, ArtifactRow.manifest)
                     .where(ArtifactRow.manifest.like(f'%"{digest}"%')))
    return sorted(Digest.parse(d) for d, raw in rows if digest in _parents(raw))


def attestation_digests(s: Session, digest: Digest) -> dict[int, str]:
    rows = s.execute(select(AttestationRow.id, AttestationRow.statement_digest)
                     .where(AttestationRow.artifact_digest == str(digest)))
    return {i: d for i, d in rows}


# --- gc --------------------------------------------------------------------------------

BlobDeleter = Callable[[Digest], bool]  # True when the blob is gone from the store
DELETIONS_KEPT = timedelta(days=30)  # pushes that span longer than this are not protected
_BATCH = 500


@dataclass(frozen=True, slots=True)
class ArtifactLinks:
    """What gc needs to know of one artifact."""

    digest: Digest
    created_at: datetime
    tagged: bool
    parents: tuple[Digest, ...]
    blobs: tuple[Digest, ...]



def _chunks(keys: list[str]) -> Iterable[list[str]]:
    for i in range(0, len(keys), _BATCH):
        yield keys[i:i + _BATCH]


def inventory(s: Session) -> list[ArtifactLinks]:
    tagged = set(s.scalars(select(TagRow.artifact_digest).distinct()))
    blobs: dict[str, list[Digest]] = {}
    for a, b in s.execute(select(ArtifactBlobRow.artifact_digest, ArtifactBlobRow.blob_digest)):
        blobs.setdefault(a, []).append(Digest.parse(b))
    rows = s.execute(select(ArtifactRow.digest, ArtifactRow.created_at, ArtifactRow.manifest)
                     .order_by(ArtifactRow.created_at))
    return [ArtifactLinks(Digest.parse(d), aware(at), d in tagged, _parents(raw),
                          tuple(blobs.get(d, ()))) for d, at, raw in rows]


def lock_for_gc(s: Session) -> None:
    """Hold off every push commit for the rest of this transaction (see kvgraft.gc).

    A push commit writes `blobs` first, then `artifacts` and `artifact_blobs`, holding
    ROW EXCLUSIVE on each until it commits; SHARE ROW EXCLUSIVE waits for those and
    blocks new ones. SQLite writers already exclude each other (BEGIN IMMEDIATE)."""
    if s.get_bind().dialect.name == "postgresql":
        # oci_blob_links: what `kvgraft serve` writes when an OCI client pushes a blob.
        s.execute(text("LOCK TABLE blobs, artifacts, artifact_blobs, oci_blob_links "
                       "IN SHARE ROW EXCLUSIVE MODE"))


def delete_artifacts(s: Session, digests: Iterable[Digest],
                     created_before: datetime) -> list[Digest]:
    gone: list[Digest] = []
    for keys in _chunks([str(d) for d in digests]):
        locked = list(s.scalars(select(ArtifactRow.digest).where(
            ArtifactRow.digest.in_(keys), ArtifactRow.created_at < created_before,
            ~exists().where(TagRow.artifact_digest == ArtifactRow.digest)).with_for_update()))
        # A tag that committed while we waited for those row locks saves its artifact;
        # a fresh statement sees it (READ COMMITTED).
        tagged = set(s.scalars(select(TagRow.artifact_digest).where(
            TagRow.artifact_digest.in_(locked)))) if locked else set()
        doomed = [d for d in locked if d not in tagged]
        if not doomed:
            continue
        s.execute(delete(AttestationRow).where(AttestationRow.artifact_digest.in_(doomed)))
        # Chunks, blob links, labels and repository links go with it (ON DELETE CASCADE).
        s.execute(delete(ArtifactRow).where(ArtifactRow.digest.in_(doomed)))
        gone += [Digest.parse(d) for d in doomed]
    return sorted(gone)


def prune_deletions(s: Session, now: datetime) -> None:
    s.execute(delete(BlobDeletionRow).where(BlobDeletionRow.deleted_at < now - DELETIONS_KEPT))


def record_deletions(s: Session, digests: Iterable[Digest], now: datetime) -> None:
    rows = [{"digest": str(d), "deleted_at": now} for d in digests]
    if rows:
        s.execute(insert(BlobDeletionRow), rows)


def sweep(s: Session, digests: list[Digest], delete_blob: BlobDeleter) -> list[Digest]:
    referenced: set[str] = set()
    for keys in _chunks([str(d) for d in digests]):
        referenced.update(s.scalars(select(ArtifactBlobRow.blob_digest).distinct()
                                    .where(ArtifactBlobRow.blob_digest.in_(keys))))
        referenced.update(s.scalars(select(OciBlobLinkRow.digest).distinct()
                                    .where(OciBlobLinkRow.digest.in_(keys))))
    gone = [d for d in digests if str(d) not in referenced and delete_blob(d)]
    for keys in _chunks([str(d) for d in gone]):
        s.execute(delete(BlobRow).where(BlobRow.digest.in_(keys)))
    return gone


def deleted_among(s: Session, digests: Iterable[Digest]) -> set[Digest]:
    out: set[Digest] = set()
    for keys in _chunks(sorted({str(d) for d in digests})):
        out.update(Digest.parse(d) for d in s.scalars(
            select(BlobDeletionRow.digest).distinct().where(BlobDeletionRow.digest.in_(keys))))
    return out


def refresh_blobs(s: Session, upsert: Any, blobs: Iterable[BlobRecord], now: datetime) -> None:
    for b in blobs:
        s.execute(upsert.values(digest=str(b.digest), size=b.size, stored_size=b.stored_size,
                                codec=b.codec, created_at=now).on_conflict_do_update(
            index_elements=["digest"], set_={"stored_size": b.stored_size, "codec": b.codec}))

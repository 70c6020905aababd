"""The event log's hash chain: appending a link, reading the chain back, checking it.

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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from kvgraft.catalog.models import EventRow
from kvgraft.catalog.records import EventRecord
from kvgraft.digest import Digest, canonical_json

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

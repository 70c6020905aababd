"""The Catalog: typed queries over the SQL catalog, returning frozen records."""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, delete, func, select
from sqlalchemy.orm import Session

from kvgraft.catalog import events as chain
from kvgraft.catalog import gcquery, lifecycle, lineage, usagequery
from kvgraft.catalog.models import (
    ArtifactBlobRow,
    ArtifactChunkRow,
    ArtifactRow,
    AttestationRow,
    BlobRow,
    EventRow,
    LabelRow,
    ModelRow,
    RepositoryArtifactRow,
    RepositoryQuotaRow,
    TagRow,
)
from kvgraft.catalog.reader import CatalogReader, tag_records
from kvgraft.catalog.records import (
    ArtifactRecord,
    AttestationRecord,
    BlobRecord,
    EventRecord,
    PushOutcome,
    PushRecord,
    TagRecord,
    aware,
    stored_digest,
)
from kvgraft.catalog.usage import Quota, UsageReport
from kvgraft.digest import Digest, canonical_json
from kvgraft.errors import NotFound, QuotaExceeded
from kvgraft.reference import Reference


def _now() -> datetime:
    return datetime.now(UTC)


class Catalog(CatalogReader):
    """The ORM-backed queries; opening, the schema check and the tag listing come from
    `CatalogReader`, which a command that only lists can use without loading the ORM."""

    @classmethod
    def from_reader(cls, reader: CatalogReader) -> Catalog:
        """The full catalog over a reader's engine (its schema already checked)."""
        return reader if isinstance(reader, Catalog) else cls(reader.engine, reader.url)

    @contextmanager
    def _session(self, *, write: bool = False) -> Iterator[Session]:
        with self._guard(), self.engine.connect() as conn:
            if write:
                conn = conn.execution_options(kvgraft_write=True)
            with Session(conn) as session, session.begin():
                yield session

    def _insert(self, table: Any) -> Any:
        # The dialect's own insert (ON CONFLICT). Imported here, and only the one in use:
        # the PostgreSQL dialect module alone costs a read-only command ~0.1 s to load.
        name = "sqlite" if self.engine.dialect.name == "sqlite" else "postgresql"
        return importlib.import_module(f"sqlalchemy.dialects.{name}").insert(table)

    # --- writes ------------------------------------------------------------------------

    def record_push(self, push: PushRecord) -> PushOutcome:
        """Commit one push: blobs, model, artifact, chunks, repository, labels, tag, event;
        past the repository's quota, evictions first or nothing (kvgraft.catalog.lifecycle)."""
        try:
            return self._record_push(push)
        except QuotaExceeded as e:
            self._refused(push.event, e)
            raise

    def _refused(self, event: EventRecord, e: QuotaExceeded) -> None:
        # The change rolled back; its refusal is on record, where `kvgraft log` counts it.
        self.add_event(dataclasses.replace(event, outcome="refused", detail={
            **event.detail, "reason": "quota", "error": e.message}))

    def _evict(self, s: Session, repository: str, digest: str, event: EventRecord,
               now: datetime) -> tuple[Digest, ...]:
        evicted = lifecycle.enforce_quota(s, repository, digest)
        if evicted:
            self._add_event(s, EventRecord(
                action="evict", actor=event.actor, host=event.host, repository=repository,
                detail={"reason": "quota", "for": digest,
                        "artifacts": [str(d) for d in evicted]}), now)
        return tuple(evicted)

    def _record_push(self, push: PushRecord) -> PushOutcome:
        m = push.manifest
        digest = str(m.digest)
        now = _now()
        with self._session(write=True) as s:
            if push.blobs:
                s.execute(self._insert(BlobRow).on_conflict_do_nothing(), [
                    {"digest": str(b.digest), "size": b.size, "stored_size": b.stored_size,
                     "codec": b.codec, "created_at": now} for b in push.blobs])
            ident = m.model
            s.execute(self._insert(ModelRow).values(
                identity=str(ident.key), architecture=str(ident.architecture),
                tokenizer=str(ident.tokenizer),
                weights=str(ident.weights) if ident.weights else None,
                name=m.model_name, config=canonical_json(dict(m.model_config)).decode(),
                created_at=now).on_conflict_do_nothing())
            model_id = s.scalar(select(ModelRow.id).where(ModelRow.identity == str(ident.key)))
            created = s.scalar(self._insert(ArtifactRow).values(
                digest=digest, model_id=model_id, manifest=m.canonical().decode(), size=m.size,
                token_count=m.token_count, chunk_tokens=m.chunk_tokens,
                file_digest=str(m.file_digest), file_size=m.file_size, created_at=now,
            ).on_conflict_do_nothing().returning(ArtifactRow.digest)) is not None
            if created:
                s.execute(self._insert(ArtifactBlobRow), [
                    {"artifact_digest": digest, "blob_digest": str(b.digest)} for b in m.blobs()])
                s.execute(self._insert(ArtifactChunkRow), [
                    {"artifact_digest": digest, "idx": c.index, "start": c.start, "end": c.end,
                     "blob_digest": str(c.digest), "prefix_key": str(c.prefix),
                     "created_at": now}
                    for c in m.chunks])
            s.execute(self._insert(RepositoryArtifactRow).values(
                repository=push.repository, artifact_digest=digest, created_at=now,
            ).on_conflict_do_nothing())
            for key, value in push.labels.items():
                stmt = self._insert(LabelRow).values(repository=push.repository,
                                                     artifact_digest=digest, key=key, value=value)
                s.execute(stmt.on_conflict_do_update(
                    index_elements=["repository", "artifact_digest", "key"],
                    set_={"value": value}))
            previous = None
            if push.tag is not None:
                previous = self._move_tag(s, push.repository, push.tag, digest, now)
            evicted = self._evict(s, push.repository, digest, push.event, now)
            self._add_event(s, push.event, now)
        return PushOutcome(created, previous, evicted)

    def _move_tag(self, s: Session, repository: str, tag: str, digest: str,
                  now: datetime) -> Digest | None:
        old = s.scalar(select(TagRow.artifact_digest).where(
            TagRow.repository == repository, TagRow.tag == tag))
        # An upsert, not read-then-write: concurrent movers each land and the last wins.
        stmt = self._insert(TagRow).values(
            repository=repository, tag=tag, artifact_digest=digest, updated_at=now)
        s.execute(stmt.on_conflict_do_update(
            index_elements=["repository", "tag"],
            set_={"artifact_digest": digest, "updated_at": now}))
        return stored_digest(old, "tags") if old else None

    def set_tag(self, repository: str, tag: str, digest: Digest,
                event: EventRecord) -> Digest | None:
        now = _now()
        try:
            with self._session(write=True) as s:
                self._require_artifact(s, digest, lock=True)
                s.execute(self._insert(RepositoryArtifactRow).values(
                    repository=repository, artifact_digest=str(digest), created_at=now,
                ).on_conflict_do_nothing())
                previous = self._move_tag(s, repository, tag, str(digest), now)
                self._evict(s, repository, str(digest), event, now)
                self._add_event(s, event, now)
        except QuotaExceeded as e:
            self._refused(event, e)
            raise
        return previous

    def pin(self, repository: str, digest: Digest, pinned: bool,
            event: EventRecord) -> None:
        """Pin (or unpin) `digest` in `repository`: exempt from `gc --unused-for` and from
        quota eviction there."""
        now = _now()
        with self._session(write=True) as s:
            lifecycle.set_pin(s, repository, digest, pinned)
            self._add_event(s, event, now)

    def set_quota(self, repository: str, max_bytes: int | None,
                  event: EventRecord) -> int | None:
        """Set (None: remove) `repository`'s byte quota; returns the previous one. It binds
        the next push or tag there: what the repository holds already stays."""
        now = _now()
        with self._session(write=True) as s:
            old = lifecycle.set_quota(s, self._insert(RepositoryQuotaRow), repository,
                                      max_bytes, now)
            self._add_event(s, dataclasses.replace(event, detail={
                **event.detail, "max_bytes": max_bytes, "previous": old}), now)
        return old

    def quotas(self) -> list[Quota]:
        """Each repository with a quota, and what it holds against it."""
        with self._session() as s:
            return [Quota(r, q, lifecycle.held_bytes(s, r))
                    for r, q in lifecycle.quotas(s).items()]

    def remove_tag(self, repository: str, tag: str, event: EventRecord) -> Digest:
        now = _now()
        with self._session(write=True) as s:
            old = s.scalar(delete(TagRow).where(
                TagRow.repository == repository, TagRow.tag == tag,
            ).returning(TagRow.artifact_digest))
            if old is None:
                raise NotFound(f"no tag {repository}:{tag}")
            digest = stored_digest(old, "tags")
            self._add_event(s, dataclasses.replace(event, digest=digest), now)
        return digest

    def add_attestation(self, att: AttestationRecord,
                        event: EventRecord | None = None) -> int:
        """Store an attestation (and its event) in one transaction; returns its id."""
        now = _now()
        with self._session(write=True) as s:
            self._require_artifact(s, att.artifact)
            row = AttestationRow(
                artifact_digest=str(att.artifact), predicate_type=att.predicate_type,
                statement=att.statement.decode(), statement_digest=str(att.statement_digest),
                envelope=att.envelope.decode() if att.envelope is not None else None,
                keyid=att.keyid, created_at=now)
            s.add(row)
            if event is not None:
                self._add_event(s, event, now)
            s.flush()
            return row.id

    def attestations(self, digest: Digest,
                     predicate_type: str | None = None) -> list[AttestationRecord]:
        q = select(AttestationRow).where(AttestationRow.artifact_digest == str(digest))
        if predicate_type is not None:
            q = q.where(AttestationRow.predicate_type == predicate_type)
        with self._session() as s:
            return [AttestationRecord(
                artifact=stored_digest(a.artifact_digest, "attestations"),
                predicate_type=a.predicate_type,
                statement=a.statement.encode(),
                envelope=a.envelope.encode() if a.envelope is not None else None,
                keyid=a.keyid, created_at=aware(a.created_at), id=a.id)
                for a in s.scalars(q.order_by(AttestationRow.id))]

    def add_event(self, event: EventRecord) -> None:
        with self._session(write=True) as s:
            self._add_event(s, event, _now())

    def _add_event(self, s: Session, e: EventRecord, now: datetime) -> None:
        # A use's event carries the artifact's last use with it. Written before the chain's
        # lock is taken: every writer locks tables first, that lock last (no deadlock).
        lifecycle.note_use(s, e, now)
        # Hash-chained and serialised with other writers: see kvgraft.catalog.events.
        chain.append_event(s, e, now)

    # --- reads -------------------------------------------------------------------------

    def resolve(self, ref: Reference) -> Digest:
        with self._session() as s:
            if ref.digest is not None:
                found = s.scalar(select(RepositoryArtifactRow.artifact_digest).where(
                    RepositoryArtifactRow.repository == ref.name,
                    RepositoryArtifactRow.artifact_digest == str(ref.digest)))
            else:
                found = s.scalar(select(TagRow.artifact_digest).where(
                    TagRow.repository == ref.name, TagRow.tag == ref.tag))
        if found is None:
            raise NotFound(f"{ref} is not in the catalog",
                           hint="`kvgraft ls` lists what the catalog holds")
        return stored_digest(found, "tags")

    def has_artifact(self, digest: Digest) -> bool:
        with self._session() as s:
            return s.get(ArtifactRow, str(digest)) is not None

    def artifact(self, digest: Digest, repository: str | None = None) -> ArtifactRecord:
        """The artifact's row; its `labels` are those set in `repository` (or, without
        one, every repository's, the first repository by name winning a key)."""
        with self._session() as s:
            row = self._require_artifact(s, digest)
            stored = s.scalar(select(func.coalesce(func.sum(BlobRow.stored_size), 0))
                              .join(ArtifactBlobRow, ArtifactBlobRow.blob_digest == BlobRow.digest)
                              .where(ArtifactBlobRow.artifact_digest == row.digest))
            model_name = s.scalar(select(ModelRow.name).where(ModelRow.id == row.model_id))
            repos = s.scalars(select(RepositoryArtifactRow.repository).where(
                RepositoryArtifactRow.artifact_digest == row.digest)
                .order_by(RepositoryArtifactRow.repository)).all()
            tags = self._tags(s, select(TagRow).where(TagRow.artifact_digest == row.digest))
            by_repo: dict[str, dict[str, str]] = {}
            for lb in s.scalars(select(LabelRow).where(LabelRow.artifact_digest == row.digest)
                                .order_by(LabelRow.repository.desc())):
                by_repo.setdefault(lb.repository, {})[lb.key] = lb.value
            labels = by_repo.get(repository, {}) if repository is not None else {
                k: v for r in by_repo.values() for k, v in r.items()}
            return ArtifactRecord(
                digest=digest, manifest=row.manifest.encode(), size=row.size,
                stored_size=int(stored or 0), token_count=row.token_count,
                model_name=model_name or "", created_at=aware(row.created_at),
                repositories=tuple(repos), tags=tags, labels=labels,
                repository_labels=by_repo,
                last_used=aware(row.last_used_at) if row.last_used_at else None,
                pinned=lifecycle.pinned_in(s, digest))

    def _require_artifact(self, s: Session, digest: Digest, *,
                          lock: bool = False) -> ArtifactRow:
        # `lock` holds a share lock on the row until commit (PostgreSQL; SQLite writers hold
        # the database lock anyway), so gc cannot delete an artifact being tagged.
        row = s.get(ArtifactRow, str(digest), with_for_update={"read": True} if lock else None)
        if row is None:
            raise NotFound(f"artifact {digest} is not in the catalog")
        return row

    @staticmethod
    def _tags(s: Session, query: Select[TagRow],
              problems: list[str] | None = None) -> tuple[TagRecord, ...]:
        rows = s.scalars(query.order_by(TagRow.repository, TagRow.tag))
        return tag_records(((t.repository, t.tag, t.artifact_digest, t.updated_at)
                            for t in rows), problems)

    def blob_records(self, digests: Iterable[Digest]) -> dict[Digest, BlobRecord]:
        keys = [str(d) for d in digests]
        out: dict[Digest, BlobRecord] = {}
        with self._session() as s:
            for i in range(0, len(keys), 500):
                for b in s.scalars(select(BlobRow).where(BlobRow.digest.in_(keys[i:i + 500]))):
                    d = stored_digest(b.digest, "blobs")
                    out[d] = BlobRecord(d, b.size, b.stored_size, b.codec)
        return out

    def artifact_digests(self) -> list[Digest]:
        with self._session() as s:
            return [stored_digest(d, "artifacts") for d in
                    s.scalars(select(ArtifactRow.digest).order_by(ArtifactRow.created_at))]

    def events(self, *, digest: Digest | None = None, action: str | None = None,
               since: datetime | None = None, limit: int | None = None) -> list[EventRecord]:
        q = select(EventRow).order_by(EventRow.id)
        if digest is not None:
            q = q.where(EventRow.digest == str(digest))
        if action is not None:
            q = q.where(EventRow.action == action)
        if since is not None:
            q = q.where(EventRow.at >= since)
        if limit is not None:
            q = q.limit(limit)
        with self._session() as s:
            return [EventRecord(
                action=e.action, actor=e.actor, host=e.host, outcome=e.outcome,
                repository=e.repository, tag=e.tag,
                digest=stored_digest(e.digest, "events") if e.digest else None,
                detail=json.loads(e.detail), at=aware(e.at), id=e.id)
                for e in s.scalars(q)]

    def usage(self, pattern: str | None = None, *,
              visible: Callable[[str], bool] | None = None) -> UsageReport:
        """What the repositories matching `pattern` (those `visible` admits) hold and how
        much they are used (kvgraft.catalog.usage)."""
        with self._session() as s:
            names = [n for n in usagequery.repository_names(s, pattern)
                     if visible is None or visible(n)]
            return usagequery.usage(s, names)

    # --- audit, lineage and gc: the queries live in catalog.events, .lineage, .gcquery ---

    def event_chain(self) -> chain.ChainReport:
        """Check the whole event log's hash chain."""
        with self._session() as s:
            return chain.check_chain(chain.read_chain(s))

    def event_trigger_problems(self) -> list[str]:
        """Missing or disabled append-only triggers on the event log."""
        from kvgraft.catalog.triggers import trigger_problems

        with self._session() as s:
            return trigger_problems(s)

    def attestation_digests(self, digest: Digest) -> dict[int, str]:
        """The statement digest recorded beside each attestation of `digest` when stored."""
        with self._session() as s:
            return lineage.attestation_digests(s, digest)

    def children(self, digest: Digest) -> list[Digest]:
        """Artifacts whose manifest names `digest` as a parent."""
        with self._session() as s:
            return lineage.children(s, digest)

    def gc_inventory(self) -> list[gcquery.ArtifactLinks]:
        with self._session() as s:
            return gcquery.inventory(s)

    def delete_artifacts(self, digests: Iterable[Digest], *, created_before: datetime | None,
                         event: EventRecord, unused_before: datetime | None = None,
                         ) -> list[Digest]:
        """Delete the artifacts among `digests` that are untagged and created before
        `created_before`, or unused since `unused_before`, and pinned nowhere (re-checked
        under the gc lock), with their attestations and tags; logs `event`."""
        now = _now()
        with self._session(write=True) as s:
            gcquery.lock_for_gc(s)
            gone = gcquery.delete_artifacts(s, digests, created_before, unused_before)
            gcquery.prune_deletions(s, now)
            detail = {**event.detail, "artifacts_deleted": [str(d) for d in gone]}
            self._add_event(s, dataclasses.replace(event, detail=detail), now)
        return gone

    def sweep_blobs(self, digests: Iterable[Digest], delete_blob: gcquery.BlobDeleter, *,
                    planned_at: datetime, uploaded_after: datetime) -> list[Digest]:
        """Delete from the store and the catalog the blobs among `digests` that no artifact
        references, no OCI manifest put since `planned_at` names, and no repository linked
        after `uploaded_after`; see kvgraft.transfer.gc for why this is safe while others
        push."""
        wanted = list(digests)
        with self._session(write=True) as s:
            gcquery.record_deletions(s, wanted, _now())
        with self._session(write=True) as s:
            gcquery.lock_for_gc(s)
            return gcquery.sweep(s, wanted, delete_blob, planned_at, uploaded_after)

    def deleted_blobs(self, digests: Iterable[Digest]) -> set[Digest]:
        """The blobs among `digests` that a gc has deleted (or set out to) at some time."""
        with self._session() as s:
            return gcquery.deleted_among(s, digests)

    def refresh_blobs(self, blobs: Iterable[BlobRecord]) -> None:
        """Make the blob rows describe what the store holds now (after a re-upload)."""
        with self._session(write=True) as s:
            gcquery.refresh_blobs(s, self._insert(BlobRow), blobs, _now())

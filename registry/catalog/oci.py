"""OCI content that is not a graft (what stock OCI clients push): blob links per repository,
manifests with their exact bytes, and their tags. Grafts stay in the kvgraft tables; the
queries here that read those answer "is this blob or digest part of a graft in repo R"."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Select, delete, func, select

from kvgraft.catalog.catalog import Catalog
from kvgraft.catalog.models import (
    ArtifactBlobRow,
    ArtifactRow,
    BlobRow,
    GraftOciObjectRow,
    OciBlobLinkRow,
    OciManifestRow,
    OciTagRow,
    RepositoryArtifactRow,
    TagRow,
)
from kvgraft.catalog.records import EventRecord, aware
from kvgraft.digest import Digest
from kvgraft.errors import Conflict


@dataclass(frozen=True, slots=True)
class OciManifest:
    repository: str
    digest: str
    media_type: str
    artifact_type: str | None
    subject: str | None
    content: bytes
    created_at: datetime


def _manifest(row: OciManifestRow) -> OciManifest:
    return OciManifest(row.repository, row.digest, row.media_type, row.artifact_type,
                       row.subject, bytes(row.content), aware(row.created_at))


class OciTables:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    # --- blobs -------------------------------------------------------------------------

    def link_blob(self, repository: str, digest: str, size: int) -> None:
        with self.catalog._session(write=True) as s:
            s.execute(self.catalog._insert(OciBlobLinkRow).values(
                repository=repository, digest=digest, size=size,
                created_at=datetime.now(UTC)).on_conflict_do_nothing())

    def unlink_blob(self, repository: str, digest: str) -> bool:
        with self.catalog._session(write=True) as s:
            gone = s.execute(delete(OciBlobLinkRow).where(
                OciBlobLinkRow.repository == repository, OciBlobLinkRow.digest == digest))
            return bool(gone.rowcount)  # type: ignore[attr-defined]

    def blob_size(self, repository: str, digest: str) -> int | None:
        """The size of blob `digest` as repository `repository` holds it, or None."""
        with self.catalog._session() as s:
            size = s.scalar(select(OciBlobLinkRow.size).where(
                OciBlobLinkRow.repository == repository, OciBlobLinkRow.digest == digest))
            if size is not None:
                return int(size)
            size = s.scalar(self._graft_blob_size(repository, digest))
            return None if size is None else int(size)

    def in_graft(self, repository: str, digest: str) -> bool:
        """Whether blob `digest` is a chunk of a graft in `repository` (whatever links the
        repository also keeps for it: the upload that brought it in makes one)."""
        with self.catalog._session() as s:
            return s.scalar(self._graft_blob_size(repository, digest)) is not None

    @staticmethod
    def _graft_blob_size(repository: str, digest: str) -> Select[int]:
        return (select(BlobRow.size)
                .join(ArtifactBlobRow, ArtifactBlobRow.blob_digest == BlobRow.digest)
                .join(RepositoryArtifactRow, RepositoryArtifactRow.artifact_digest
                      == ArtifactBlobRow.artifact_digest)
                .where(BlobRow.digest == digest,
                       RepositoryArtifactRow.repository == repository).limit(1))

    def graft_in(self, repository: str, digest: str) -> bool:
        """Whether `digest` is a graft's artifact digest in `repository`."""
        with self.catalog._session() as s:
            return s.scalar(select(RepositoryArtifactRow.artifact_digest).where(
                RepositoryArtifactRow.repository == repository,
                RepositoryArtifactRow.artifact_digest == digest)) is not None

    def has_grafts(self, repository: str) -> bool:
        with self.catalog._session() as s:
            return s.scalar(select(RepositoryArtifactRow.artifact_digest).where(
                RepositoryArtifactRow.repository == repository).limit(1)) is not None

    def any_blob_size(self, digest: str) -> int | None:
        """The size of `digest` in any repository (for cross-repository mounts)."""
        with self.catalog._session() as s:
            size = s.scalar(select(OciBlobLinkRow.size).where(
                OciBlobLinkRow.digest == digest).limit(1))
            return None if size is None else int(size)

    def kept_blobs(self, uploaded_after: datetime) -> set[Digest]:
        """What gc keeps for OCI clients: every blob an OCI manifest references, and every
        blob uploaded (linked) after `uploaded_after`, whose manifest or push commit may
        still be on its way. An older link with nothing referencing its blob holds nothing
        (as in an OCI registry's gc): kvgraft pushes through a server link their blobs too,
        and those bytes must go when their artifacts do."""
        with self.catalog._session() as s:
            found = set(s.scalars(select(OciBlobLinkRow.digest).distinct().where(
                OciBlobLinkRow.created_at >= uploaded_after)))
            for raw in s.scalars(select(OciManifestRow.blobs)):
                found.update(json.loads(raw))
        return {Digest.parse(d) for d in found}

    # --- manifests and tags ------------------------------------------------------------

    def put_manifest(self, m: OciManifest, blobs: list[str], tags: list[str],
                     event: EventRecord) -> None:
        now = datetime.now(UTC)
        with self.catalog._session(write=True) as s:
            for tag in tags:
                if s.scalar(select(TagRow.artifact_digest).where(
                        TagRow.repository == m.repository, TagRow.tag == tag)) is not None:
                    raise Conflict(f"{m.repository}:{tag} names a kvgraft graft",
                                   hint="untag it with `kvgraft untag` first")
            s.execute(self.catalog._insert(OciManifestRow).values(
                repository=m.repository, digest=m.digest, media_type=m.media_type,
                artifact_type=m.artifact_type, subject=m.subject, content=m.content,
                blobs=json.dumps(blobs), created_at=now).on_conflict_do_nothing())
            for tag in tags:
                s.execute(self.catalog._insert(OciTagRow).values(
                    repository=m.repository, tag=tag, digest=m.digest, updated_at=now,
                ).on_conflict_do_update(index_elements=["repository", "tag"],
                                        set_={"digest": m.digest, "updated_at": now}))
            self.catalog._add_event(s, event, now)

    def manifest(self, repository: str, digest: str) -> OciManifest | None:
        with self.catalog._session() as s:
            row = s.get(OciManifestRow, (repository, digest))
            return _manifest(row) if row is not None else None

    def tag_digest(self, repository: str, tag: str) -> str | None:
        with self.catalog._session() as s:
            return s.scalar(select(OciTagRow.digest).where(
                OciTagRow.repository == repository, OciTagRow.tag == tag))

    def tags(self, repository: str, *, last: str | None = None,
             limit: int | None = None) -> list[str]:
        """Tag names of `repository` (grafts' and OCI manifests'), sorted, after `last`."""
        with self.catalog._session() as s:
            names = set(s.scalars(select(TagRow.tag).where(TagRow.repository == repository)))
            names |= set(s.scalars(select(OciTagRow.tag).where(
                OciTagRow.repository == repository)))
        out = sorted(n for n in names if last is None or n > last)
        return out if limit is None else out[:limit]

    def repository_exists(self, repository: str) -> bool:
        with self.catalog._session() as s:
            for table, col in ((RepositoryArtifactRow, RepositoryArtifactRow.repository),
                               (OciManifestRow, OciManifestRow.repository),
                               (OciBlobLinkRow, OciBlobLinkRow.repository)):
                if s.scalar(select(func.count()).select_from(table).where(
                        col == repository)):
                    return True
        return False

    def delete_manifest(self, repository: str, digest: str, event: EventRecord) -> bool:
        now = datetime.now(UTC)
        with self.catalog._session(write=True) as s:
            gone = s.execute(delete(OciManifestRow).where(
                OciManifestRow.repository == repository, OciManifestRow.digest == digest))
            if not gone.rowcount:  # type: ignore[attr-defined]
                return False
            s.execute(delete(OciTagRow).where(OciTagRow.repository == repository,
                                              OciTagRow.digest == digest))
            self.catalog._add_event(s, event, now)
            return True

    def delete_tag(self, repository: str, tag: str, event: EventRecord) -> bool:
        now = datetime.now(UTC)
        with self.catalog._session(write=True) as s:
            gone = s.execute(delete(OciTagRow).where(OciTagRow.repository == repository,
                                                     OciTagRow.tag == tag))
            if not gone.rowcount:  # type: ignore[attr-defined]
                return False
            self.catalog._add_event(s, event, now)
            return True

    def referrers(self, repository: str, subject: str) -> list[OciManifest]:
        with self.catalog._session() as s:
            return [_manifest(r) for r in s.scalars(select(OciManifestRow).where(
                OciManifestRow.repository == repository, OciManifestRow.subject == subject)
                .order_by(OciManifestRow.digest))]

    # --- grafts rendered as OCI manifests ----------------------------------------------

    def remember(self, digest: str, kind: str, artifact_digest: str,
                 attestation_id: int | None = None) -> None:
        with self.catalog._session(write=True) as s:
            s.execute(self.catalog._insert(GraftOciObjectRow).values(
                digest=digest, kind=kind, artifact_digest=artifact_digest,
                attestation_id=attestation_id).on_conflict_do_nothing())

    def rendered(self, repository: str, digest: str, kind: str,
                 ) -> tuple[str, int | None] | None:
        """(artifact digest, attestation id) that OCI object `digest` of `kind` stands for,
        if that graft is in `repository`."""
        with self.catalog._session() as s:
            row = s.execute(select(GraftOciObjectRow.artifact_digest,
                                   GraftOciObjectRow.attestation_id)
                            .join(RepositoryArtifactRow, RepositoryArtifactRow.artifact_digest
                                  == GraftOciObjectRow.artifact_digest)
                            .join(ArtifactRow, ArtifactRow.digest
                                  == GraftOciObjectRow.artifact_digest)
                            .where(GraftOciObjectRow.digest == digest,
                                   GraftOciObjectRow.kind == kind,
                                   RepositoryArtifactRow.repository == repository)
                            .limit(1)).first()
            return None if row is None else (row[0], row[1])

    def graft_for(self, repository: str, oci_digest: str) -> str | None:
        """The graft (artifact digest) in `repository` that OCI manifest `oci_digest` renders."""
        found = self.rendered(repository, oci_digest, "manifest")
        return None if found is None else found[0]

"""What the Registry's services ask of a catalog: the SQL catalog (kvgraft.catalog.Catalog)
and a `kvgraft serve` seen over HTTP (kvgraft.remote.catalog.HttpCatalog) both provide it,
so every verb runs unchanged against either, and mypy holds both to the same signatures."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

from kvgraft.catalog.records import (
    ArtifactRecord,
    AttestationRecord,
    BlobRecord,
    EventRecord,
    PushOutcome,
    PushRecord,
    TagRecord,
)
from kvgraft.digest import Digest
from kvgraft.reference import Reference

if TYPE_CHECKING:  # the chain check loads SQLAlchemy: `kvgraft ls` need not
    from kvgraft.catalog.events import ChainReport
    from kvgraft.catalog.usage import Quota, UsageReport


class TagListing(Protocol):
    """The one read `kvgraft ls` needs: the SQL catalog's lightweight reader has it too."""

    def list_tags(self, pattern: str | None = None, *,
                  problems: list[str] | None = None) -> tuple[TagRecord, ...]: ...

    def close(self) -> None: ...


class CatalogAPI(TagListing, Protocol):
    # --- reads -------------------------------------------------------------------------

    def resolve(self, ref: Reference) -> Digest: ...

    def artifact(self, digest: Digest, repository: str | None = None) -> ArtifactRecord: ...

    def has_artifact(self, digest: Digest) -> bool: ...

    def blob_records(self, digests: Iterable[Digest]) -> dict[Digest, BlobRecord]: ...

    def artifact_digests(self) -> list[Digest]: ...

    def events(self, *, digest: Digest | None = None, action: str | None = None,
               since: datetime | None = None, limit: int | None = None,
               ) -> list[EventRecord]: ...

    def attestations(self, digest: Digest,
                     predicate_type: str | None = None) -> list[AttestationRecord]: ...

    def attestation_digests(self, digest: Digest) -> dict[int, str]: ...

    def children(self, digest: Digest) -> list[Digest]: ...

    def event_chain(self) -> ChainReport: ...

    def event_trigger_problems(self) -> list[str]: ...

    def deleted_blobs(self, digests: Iterable[Digest]) -> set[Digest]: ...

    def usage(self, pattern: str | None = None) -> UsageReport: ...

    def quotas(self) -> list[Quota]: ...

    # --- writes ------------------------------------------------------------------------

    def record_push(self, push: PushRecord) -> PushOutcome: ...

    def refresh_blobs(self, blobs: Iterable[BlobRecord]) -> None: ...

    def set_tag(self, repository: str, tag: str, digest: Digest,
                event: EventRecord) -> Digest | None: ...

    def remove_tag(self, repository: str, tag: str, event: EventRecord) -> Digest: ...

    def add_event(self, event: EventRecord) -> None: ...

    def add_attestation(self, att: AttestationRecord,
                        event: EventRecord | None = None) -> int: ...

    def pin(self, repository: str, digest: Digest, pinned: bool,
            event: EventRecord) -> None: ...

    def set_quota(self, repository: str, max_bytes: int | None,
                  event: EventRecord) -> int | None: ...

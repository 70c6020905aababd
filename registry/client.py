"""The Registry facade: what the CLI and integrations call.

A Registry settles once where its catalog, blobs and cache are (kvgraft.services.backends:
direct, through a `kvgraft serve`, or offline) and hands each verb to the service that
holds it (kvgraft.services: transfers, integrity, provenance, lifecycle, listing, events).
The methods here only delegate, so that every act has one path whatever the backends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgraft.config import Config
from kvgraft.digest import Digest
from kvgraft.identity.model import ModelIdentity
from kvgraft.reference import Reference
from kvgraft.services.backends import Backends, open_backends
from kvgraft.services.events import EventLog
from kvgraft.services.integrity import Integrity
from kvgraft.services.lifecycle import Lifecycle
from kvgraft.services.listing import Inspection, Listing
from kvgraft.services.manifests import Manifests
from kvgraft.services.policy import Policy
from kvgraft.services.provenance import Provenance
from kvgraft.services.transfers import (
    OpenedArtifact,
    PullResult,
    PushResult,
    Transfers,
    check_labels,
    check_output,
)

# The data path (codecs and numpy, manifest schemas, the stores, the SQL catalog) is
# imported by the services' methods that use it: `kvgraft ls` and the like load only the
# catalog's reader.
if TYPE_CHECKING:
    from kvgraft.blobstore import BlobStore
    from kvgraft.catalog import EventRecord, TagRecord
    from kvgraft.catalog.api import CatalogAPI, TagListing
    from kvgraft.catalog.records import AttestationRecord
    from kvgraft.catalog.usage import Quota, UsageReport
    from kvgraft.formats.manifest import Manifest
    from kvgraft.provenance import Keyring, Statement
    from kvgraft.provenance.audit import AuditReport
    from kvgraft.transfer.cache import Cache
    from kvgraft.transfer.copy import CopyStats
    from kvgraft.transfer.gc import GcPlan, GcResult
    from kvgraft.transfer.pull import Progress
    from kvgraft.transfer.push import PushOptions
    from kvgraft.transfer.verify import VerifyReport

__all__ = ["Inspection", "OpenedArtifact", "PullResult", "PushResult", "Registry",
           "check_labels", "check_output"]

STORE_ELSEWHERE = "run it on the server's host with a direct remote (--catalog, --store)"


class Registry:
    def __init__(self, config: Config, backends: Backends | None = None) -> None:
        self.config = config
        self.backends = backends or open_backends(config)
        self.events = EventLog(self.backends)
        self.user, self.host = self.events.user, self.events.host
        self.manifests = Manifests(self.backends)
        self.policy = Policy(self.backends, self.events)
        self.transfers = Transfers(self.backends, self.manifests, self.policy, self.events)
        self.integrity = Integrity(self.backends, self.manifests, self.events)
        self.lifecycle = Lifecycle(self.backends, self.events)
        self.listing = Listing(self.backends, self.manifests)
        self.trail = Provenance(self.backends, self.manifests, self.policy, self.events)

    @classmethod
    def from_env(cls, *, remote: str | None = None, **overrides: object) -> Registry:
        return cls(Config.from_env(None, remote=remote, **overrides))

    # --- the backends ------------------------------------------------------------------

    @property
    def catalog(self) -> CatalogAPI:
        return self.backends.catalog

    @property
    def catalog_reader(self) -> TagListing:
        """What lists tags (`kvgraft ls`): the SQL catalog's reader, or the server's."""
        listing = self.backends.listing()
        return listing if listing is not None else self.backends.catalog

    @property
    def store(self) -> BlobStore:
        """The blob store itself; through a server, blobs are reached per repository
        (`blob_store`), so this is refused there."""
        return self.backends.whole_store("raw blob store access", STORE_ELSEWHERE)

    def blob_store(self, repository: str | None) -> BlobStore:
        """Where the blobs of `repository` are read and written."""
        return self.backends.blobs(repository)

    @property
    def cache(self) -> Cache:
        return self.backends.cache

    @property
    def keyring(self) -> Keyring:
        return self.policy.keyring

    def require_online(self, what: str) -> None:
        self.backends.require_online(what)

    def owner_only(self, what: str, alternative: str) -> None:
        """Refuse, before anything is opened, what only the catalog's owner may do."""
        self.backends.owner_only(what, alternative)

    def close(self) -> None:
        self.backends.close()

    # --- transfers ---------------------------------------------------------------------

    def push(self, path: str | Path, ref: Reference | str, *,
             labels: Mapping[str, str] | None = None, options: PushOptions | None = None,
             progress: Progress | None = None) -> PushResult:
        return self.transfers.push(path, ref, labels=labels, options=options,
                                   progress=progress)

    def open(self, ref: Reference | Digest | str, *, require_signed_by: Sequence[str] = (),
             require_verified: bool = False, model: ModelIdentity | None = None,
             for_verification: bool = False, action: str = "load") -> OpenedArtifact:
        """The one way to open an artifact for use (kvgraft.services.transfers)."""
        return self.transfers.open(ref, require_signed_by=require_signed_by,
                                   require_verified=require_verified, model=model,
                                   for_verification=for_verification, action=action)

    def pull(self, ref: Reference | str, output: Path | None = None, *,
             progress: Progress | None = None, workers: int | None = None,
             require_signed_by: Sequence[str] = (),
             require_verified: bool | ModelIdentity = False) -> PullResult:
        return self.transfers.pull(ref, output, progress=progress, workers=workers,
                                   require_signed_by=require_signed_by,
                                   require_verified=require_verified)

    def copy(self, src: Reference | str, dst_registry: Registry, dst: Reference | str,
             ) -> tuple[Digest, CopyStats]:
        return self.transfers.copy(src, dst_registry.transfers, dst)

    def check_policy(self, ref: Reference | Digest | str, manifest: Manifest, *,
                     require_signed_by: Sequence[str] = (), require_verified: bool = False,
                     model: ModelIdentity | None = None, for_verification: bool = False,
                     action: str = "load") -> None:
        self.policy.check(ref, manifest, require_signed_by=require_signed_by,
                          require_verified=require_verified, model=model,
                          for_verification=for_verification, action=action)

    # --- names and reads ---------------------------------------------------------------

    def resolve(self, ref: Reference | str) -> Digest:
        return self.backends.resolve(Reference.parse(ref) if isinstance(ref, str) else ref)

    def manifest(self, digest: Digest) -> Manifest:
        return self.manifests.get(digest)

    def tag(self, src: Reference | str, dst: Reference | str) -> Digest:
        return self.lifecycle.tag(src, dst)

    def untag(self, ref: Reference | str) -> Digest:
        return self.lifecycle.untag(ref)

    def list(self, pattern: str | None = None, *,
             problems: list[str] | None = None) -> tuple[TagRecord, ...]:
        return self.listing.list(pattern, problems=problems)

    def inspect(self, ref: Reference | str) -> Inspection:
        return self.listing.inspect(ref)

    # --- integrity ---------------------------------------------------------------------

    def verify(self, ref: Reference | str | None = None, *, workers: int | None = None,
               ) -> tuple[VerifyReport, ...]:
        return self.integrity.verify(ref, workers=workers)

    def repair(self, report: VerifyReport, source: Path | None = None) -> Sequence[Digest]:
        return self.integrity.repair(report, source)

    def verify_tags(self) -> tuple[str, ...]:
        return self.integrity.verify_tags()

    # --- provenance, signatures, audit and gc ------------------------------------------

    def log(self, ref: Reference | str | None = None, *, since: datetime | None = None,
            action: str | None = None) -> tuple[EventRecord, ...]:
        return self.events.log(ref, since=since, action=action)

    def stats(self, pattern: str | None = None) -> UsageReport:
        return self.listing.stats(pattern)

    def provenance(self, ref: Reference | str,
                   ) -> tuple[Statement, tuple[AttestationRecord, ...]]:
        return self.trail.statement(ref)

    def sign(self, ref: Reference | str, key: str) -> tuple[Digest, str, int]:
        return self.trail.sign(ref, key)

    def attest(self, statement: Statement, *, event_action: str = "attest",
               detail: Mapping[str, Any] | None = None) -> int:
        return self.trail.attest(statement, event_action=event_action, detail=detail)

    def audit(self, ref: Reference | str, *, workers: int | None = None) -> AuditReport:
        return self.trail.audit(ref, workers=workers)

    def pin(self, ref: Reference | str) -> Digest:
        return self.lifecycle.pin(ref, True)

    def unpin(self, ref: Reference | str) -> Digest:
        return self.lifecycle.pin(ref, False)

    def set_quota(self, repository: str, max_bytes: int | None) -> int | None:
        return self.lifecycle.set_quota(repository, max_bytes)

    def quotas(self, pattern: str | None = None) -> tuple[Quota, ...]:
        return self.lifecycle.quotas(pattern)

    def gc_plan(self, *, grace: float | None = None,
                untagged_older_than: float | None = None,
                unused_for: float | None = None) -> GcPlan:
        return self.lifecycle.gc_plan(grace=grace, untagged_older_than=untagged_older_than,
                                      unused_for=unused_for)

    def gc(self, gc_plan: GcPlan, *, allow_empty_catalog: bool = False) -> GcResult:
        return self.lifecycle.gc(gc_plan, allow_empty_catalog=allow_empty_catalog)

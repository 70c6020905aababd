"""What is in the registry: tags by repository glob, and everything about one artifact."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvgraft.catalog.records import ArtifactRecord, TagRecord
from kvgraft.reference import Reference, check_name

if TYPE_CHECKING:
    from kvgraft.catalog.usage import UsageReport
    from kvgraft.formats.manifest import Manifest
    from kvgraft.services.backends import Backends
    from kvgraft.services.manifests import Manifests


@dataclass(frozen=True, slots=True)
class Inspection:
    record: ArtifactRecord
    manifest: Manifest
    chunks: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        r, m = self.record, self.manifest
        return {
            "digest": str(r.digest), "size": r.size, "stored_size": r.stored_size,
            "token_count": m.token_count, "created_at": r.created_at.isoformat(),
            "model": {**m.model.to_json(), "name": m.model_name},
            "repositories": list(r.repositories),
            "tags": [f"{t.repository}:{t.tag}" for t in r.tags],
            "labels": dict(r.labels), "chunks": [dict(c) for c in self.chunks],
            "last_used": r.last_used.isoformat() if r.last_used else None,
            "pinned": list(r.pinned),
            "manifest": m.to_json(),
        }


class Listing:
    def __init__(self, backends: Backends, manifests: Manifests) -> None:
        self.backends = backends
        self.manifests = manifests

    def list(self, pattern: str | None = None, *,
             problems: list[str] | None = None) -> tuple[TagRecord, ...]:
        """Tags whose repository matches the shell glob `pattern` (`*`, `?`, `[seq]`,
        `[!seq]`). With `problems`, damaged tag rows are reported there, not raised."""
        if pattern and not any(ch in pattern for ch in "*?["):
            check_name(pattern)
        listing = self.backends.listing()
        if listing is None:
            return ()  # a registry never written to: listing it should not create it
        tags = listing.list_tags(pattern, problems=problems)
        if pattern:
            tags = tuple(t for t in tags if fnmatch.fnmatchcase(t.repository, pattern))
        return tags

    def stats(self, pattern: str | None = None) -> UsageReport:
        """Artifacts, bytes stored and saved by sharing chunks, hits and last use of each
        repository matching the shell glob `pattern` (kvgraft.catalog.usage); through a
        server, of those the token may pull."""
        from kvgraft.catalog.usage import RepositoryUsage, UsageReport

        if pattern and not any(ch in pattern for ch in "*?["):
            check_name(pattern)
        if self.backends.listing() is None:  # never written to: nothing to create
            return UsageReport((), RepositoryUsage("*"))
        return self.backends.catalog.usage(pattern)

    def inspect(self, ref: Reference | str) -> Inspection:
        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        digest = self.backends.resolve(ref)
        catalog = self.backends.catalog
        record = catalog.artifact(digest, ref.name)
        manifest = self.manifests.get(digest)
        blobs = catalog.blob_records(c.digest for c in manifest.chunks)
        chunks = tuple({
            "index": c.index, "start": c.start, "end": c.end, "digest": str(c.digest),
            "size": c.size, "stored_size": blobs[c.digest].stored_size if c.digest in blobs
            else None, "codec": blobs[c.digest].codec if c.digest in blobs else None,
            "prefix": str(c.prefix)} for c in manifest.chunks)
        return Inspection(record, manifest, chunks)

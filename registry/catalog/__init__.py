"""The SQL catalog: models, blobs, artifacts, tags, labels, attestations and events.

ORM rows never leave this package: callers get the frozen dataclasses of `records`.
"""

from typing import TYPE_CHECKING, Any

from kvgraft.catalog.records import (
    ArtifactRecord,
    AttestationRecord,
    BlobRecord,
    EventRecord,
    PushRecord,
    TagRecord,
)

if TYPE_CHECKING:
    from kvgraft.catalog.catalog import Catalog


def __getattr__(name: str) -> Any:
    # SQLAlchemy loads when the catalog is first used, not when a record type is imported
    # (`kvgraft ls` on a registry never written to needs neither).
    if name == "Catalog":
        from kvgraft.catalog.catalog import Catalog

        return Catalog
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ArtifactRecord",
    "AttestationRecord",
    "BlobRecord",
    "Catalog",
    "EventRecord",
    "PushRecord",
    "TagRecord",
]

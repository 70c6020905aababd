"""The SQL catalog: models, blobs, artifacts, tags, labels, attestations and events.

ORM rows never leave this package: callers get the frozen dataclasses of `records`.
"""

from kvgraft.catalog.catalog import Catalog
from kvgraft.catalog.records import (
    ArtifactRecord,
    AttestationRecord,
    BlobRecord,
    EventRecord,
    PushRecord,
    TagRecord,
)

__all__ = [
    "ArtifactRecord",
    "AttestationRecord",
    "BlobRecord",
    "Catalog",
    "EventRecord",
    "PushRecord",
    "TagRecord",
]

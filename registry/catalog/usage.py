"""What each repository holds and how much it is used: the figures of `kvgraft stats`
(the queries: kvgraft.catalog.usagequery; these records also travel over HTTP).

Bytes: `size` is what the artifacts rebuild (the sum of their sizes, as `inspect` shows
them); `referenced_bytes` the stored bytes of each artifact's blobs counted once per
artifact, `stored_bytes` those of the distinct blobs; what sharing chunks saves is the
difference (`deduplicated_bytes`). A blob shared with another repository counts in both.

Use: the catalog records no access time of its own, so hits and last use come from the
event log: every event of action restore (the vLLM connector), pull or match with outcome
ok, counted for the repository it names, or, when it names none, for every repository
holding its artifact. An event about an artifact that gc has since removed still counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

USE_ACTIONS = ("restore", "pull", "match")


@dataclass(frozen=True, slots=True)
class RepositoryUsage:
    repository: str
    artifacts: int = 0
    tags: int = 0
    size: int = 0
    referenced_bytes: int = 0
    stored_bytes: int = 0
    hits: int = 0
    last_used: datetime | None = None

    @property
    def deduplicated_bytes(self) -> int:
        return self.referenced_bytes - self.stored_bytes

    def to_json(self) -> dict[str, Any]:
        return {"repository": self.repository, "artifacts": self.artifacts,
                "tags": self.tags, "size": self.size,
                "referenced_bytes": self.referenced_bytes, "stored_bytes": self.stored_bytes,
                "deduplicated_bytes": self.deduplicated_bytes, "hits": self.hits,
                "last_used": self.last_used.isoformat() if self.last_used else None}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RepositoryUsage:
        last = raw.get("last_used")
        return cls(str(raw["repository"]), int(raw["artifacts"]), int(raw["tags"]),
                   int(raw["size"]), int(raw["referenced_bytes"]), int(raw["stored_bytes"]),
                   int(raw["hits"]), datetime.fromisoformat(last) if last else None)


@dataclass(frozen=True, slots=True)
class UsageReport:
    repositories: tuple[RepositoryUsage, ...]
    # Over the repositories listed, each artifact and blob once; hits are the
    # repositories' sum (an event about an artifact two of them hold counts in both).
    total: RepositoryUsage

    def to_json(self) -> dict[str, Any]:
        return {"repositories": [r.to_json() for r in self.repositories],
                "total": self.total.to_json()}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> UsageReport:
        return cls(tuple(RepositoryUsage.from_json(r) for r in raw["repositories"]),
                   RepositoryUsage.from_json(raw["total"]))


@dataclass(frozen=True, slots=True)
class Quota:
    """A repository's byte quota and what it holds against it (kvgraft.catalog.lifecycle)."""

    repository: str
    max_bytes: int
    held_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"repository": self.repository, "max_bytes": self.max_bytes,
                "held_bytes": self.held_bytes}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Quota:
        return cls(str(raw["repository"]), int(raw["max_bytes"]), int(raw["held_bytes"]))

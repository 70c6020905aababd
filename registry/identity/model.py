"""Model identity: the digests deciding whether a graft belongs to a model (docs/format.md §3)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from kvgraft.digest import Digest, canonical_json


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    architecture: Digest
    tokenizer: Digest
    weights: Digest | None = None

    def to_json(self) -> dict[str, str | None]:
        return {
            "architecture": str(self.architecture),
            "tokenizer": str(self.tokenizer),
            "weights": str(self.weights) if self.weights else None,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelIdentity:
        weights = data.get("weights")
        return cls(
            Digest.parse(data["architecture"]),
            Digest.parse(data["tokenizer"]),
            Digest.parse(weights) if weights else None,
        )

    @property
    def key(self) -> Digest:
        """One digest naming the whole identity (catalog key, prefix-chain seed)."""
        return _key_of(self)


# A lookup asks for its model's key a few times, and its canonical JSON cost more than the
# rest of the lookup's hashing; a process sees few models.
@functools.lru_cache(maxsize=64)
def _key_of(identity: ModelIdentity) -> Digest:
    return Digest.of(canonical_json(identity.to_json()))

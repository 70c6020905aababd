"""The compatibility report: does a graft belong to this model? (docs/format.md §3)

Identities are compared digest by digest; where the architecture digests differ, the
config values the artifact recorded are compared with the live model's field by field, so
the report names what differs (rope_parameters, num_hidden_layers, kv_dtype, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgraft.digest import canonical_json
from kvgraft.errors import IncompatibleModel
from kvgraft.identity.fingerprint import Fingerprint, architecture_digest
from kvgraft.identity.model import ModelIdentity

_MISSING = "<absent>"


@dataclass(frozen=True, slots=True)
class Mismatch:
    field: str
    expected: Any  # what the graft was made with
    found: Any  # what the live model has

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "expected": self.expected, "found": self.found}

    def human(self) -> str:
        return f"{self.field}: graft has {_short(self.expected)}, model has {_short(self.found)}"


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else canonical_json(value).decode()
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class CompatReport:
    expected: ModelIdentity
    found: ModelIdentity
    mismatches: tuple[Mismatch, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(m.field for m in self.mismatches)

    def to_json(self) -> dict[str, Any]:
        return {"compatible": self.ok, "expected": self.expected.to_json(),
                "found": self.found.to_json(),
                "mismatches": [m.to_json() for m in self.mismatches]}

    def error(self, what: str) -> IncompatibleModel:
        listing = "; ".join(m.human() for m in self.mismatches)
        return IncompatibleModel(
            f"{what} does not belong to this model: {listing}",
            hint="use a graft captured with this model, or --force-incompatible for an "
                 "experiment (recorded in the audit log)")

    def check(self, what: str) -> None:
        if not self.ok:
            raise self.error(what)


def compare(expected: ModelIdentity, expected_config: Mapping[str, Any],
            live: Fingerprint) -> CompatReport:
    """Compare a graft's recorded identity (and config) with a live model's fingerprint."""
    found = live.identity
    out: list[Mismatch] = []
    if expected.architecture != found.architecture:
        cfg = dict(expected_config)
        fields = []
        # A recorded config that hashes to the recorded digest can be trusted field by field.
        if cfg and architecture_digest(cfg) == expected.architecture:
            for key in sorted(set(cfg) | set(live.config)):
                a, b = cfg.get(key, _MISSING), live.config.get(key, _MISSING)
                if a != b:
                    fields.append(Mismatch(key, a, b))
        out += fields or [Mismatch("architecture", str(expected.architecture),
                                   str(found.architecture))]
    # a graft made before the files rule carries the instantiated tokenizer's digest
    if expected.tokenizer not in (found.tokenizer, live.legacy_tokenizer):
        out.append(Mismatch("tokenizer", str(expected.tokenizer), str(found.tokenizer)))
    if expected.weights != found.weights:
        out.append(Mismatch("weights", str(expected.weights) if expected.weights else None,
                            str(found.weights) if found.weights else None))
    return CompatReport(expected, found, tuple(out))

"""in-toto Statement v1 documents about artifacts, validated on construction.

A statement names its subject by the artifact digest (`{"sha256": <hex of the manifest
digest>}`) and carries a typed predicate. kvgraft knows two predicate types and checks
their predicates against schemas/predicate-*.schema.json; other types are stored and
exported as they came, checked only as statements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import jsonschema

from kvgraft import strictjson
from kvgraft.digest import Digest, canonical_json
from kvgraft.errors import IntegrityError
from kvgraft.formats.manifest import MEDIA_TYPE, Manifest
from kvgraft.identity.model import ModelIdentity
from kvgraft.resources import load_schema

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"  # the DSSE payloadType of a statement
PROVENANCE = "https://kvgraft.dev/attestations/provenance/v1"
FIDELITY = "https://kvgraft.dev/attestations/fidelity/v1"
PREDICATE_SCHEMAS = {PROVENANCE: "predicate-provenance", FIDELITY: "predicate-fidelity"}


def _validate(data: Any, schema: str, what: str) -> None:
    try:
        jsonschema.validate(data, load_schema(schema),
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "<root>"
        raise IntegrityError(f"{what} fails its schema at {where}: {e.message}") from None


@dataclass(frozen=True, slots=True)
class Subject:
    name: str
    digest: Digest

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "digest": {"sha256": self.digest.hex}}


@dataclass(frozen=True, slots=True)
class Statement:
    subjects: tuple[Subject, ...]
    predicate_type: str
    predicate: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Valid by construction: a Statement that exists passed both schemas.
        _validate(self.to_json(), "statement", "statement")
        schema = PREDICATE_SCHEMAS.get(self.predicate_type)
        if schema is not None:
            _validate(dict(self.predicate), schema, f"predicate {self.predicate_type}")

    @classmethod
    def about(cls, digest: Digest, predicate_type: str, predicate: Mapping[str, Any], *,
              name: str | None = None) -> Statement:
        return cls((Subject(name or str(digest), digest),), predicate_type, dict(predicate))

    def to_json(self) -> dict[str, Any]:
        return {"_type": STATEMENT_TYPE, "subject": [s.to_json() for s in self.subjects],
                "predicateType": self.predicate_type, "predicate": dict(self.predicate)}

    def canonical(self) -> bytes:
        return canonical_json(self.to_json())

    @property
    def digest(self) -> Digest:
        return Digest.of(self.canonical())

    def names(self, digest: Digest) -> bool:
        """Whether `digest` is one of this statement's subjects."""
        return any(s.digest == digest for s in self.subjects)

    @classmethod
    def from_json(cls, data: Any) -> Statement:
        _validate(data, "statement", "statement")
        subjects = []
        for s in data["subject"]:
            if "sha256" not in s["digest"]:
                raise IntegrityError("statement subject has no sha256 digest")
            subjects.append(Subject(s.get("name", ""), Digest(s["digest"]["sha256"])))
        return cls(tuple(subjects), data["predicateType"], data["predicate"])

    @classmethod
    def parse(cls, raw: bytes) -> Statement:
        try:
            data = strictjson.loads(raw)
        except ValueError as e:
            raise IntegrityError(f"statement is not JSON kvgraft accepts: {e}") from None
        return cls.from_json(data)


@dataclass(frozen=True, slots=True)
class Origin:
    """Who first pushed an artifact, from the push event."""

    by: str
    host: str
    at: datetime
    repository: str | None
    tag: str | None


def _stamp(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def provenance_statement(manifest: Manifest, origin: Origin | None, *,
                         name: str | None = None) -> Statement:
    """The kvgraft provenance statement of an artifact: what the manifest says about its
    content, model, lineage and origin, plus who first pushed it (`origin`, if known)."""
    m = manifest
    pushed = None
    if origin is not None:
        pushed = {"by": origin.by, "host": origin.host, "at": _stamp(origin.at),
                  "repository": origin.repository, "tag": origin.tag}
    predicate = {
        "artifact": {"digest": str(m.digest), "mediaType": MEDIA_TYPE, "size": m.size,
                     "tokenCount": m.token_count, "chunkTokens": m.chunk_tokens,
                     "tokens": str(m.tokens.digest),
                     "file": {"digest": str(m.file_digest), "size": m.file_size}},
        "model": {**m.model.to_json(), "name": m.model_name},
        "parents": [{"digest": str(p)} for p in m.parents],
        "provenance": dict(m.provenance),
        "pushed": pushed,
    }
    return Statement.about(m.digest, PROVENANCE, predicate,
                           name=name or (origin.repository if origin else None))


def fidelity_statement(digest: Digest, model: ModelIdentity, passed: bool, *,
                       details: Mapping[str, Any] | None = None,
                       checked_at: datetime | None = None) -> Statement:
    """A fidelity result for `digest` checked on `model` (the contract of FIDELITY)."""
    predicate = {**(details or {}), "model": model.to_json(), "passed": passed,
                 "checkedAt": _stamp(checked_at or datetime.now(UTC))}
    return Statement.about(digest, FIDELITY, predicate)


def fidelity_identity(statement: Statement) -> ModelIdentity:
    """The model identity a fidelity statement was checked on."""
    if statement.predicate_type != FIDELITY:
        raise IntegrityError(f"not a fidelity statement: {statement.predicate_type}")
    return ModelIdentity.from_json(dict(statement.predicate["model"]))

"""The JSON form of catalog records between an HTTP remote and `kvgraft serve`: one
module both sides use, so what the server writes is exactly what the client reads."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from kvgraft.catalog.events import ChainProblem, ChainReport
from kvgraft.catalog.records import (
    ArtifactRecord,
    AttestationRecord,
    BlobRecord,
    EventRecord,
    TagRecord,
)
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


def _digest(text: str | None) -> Digest | None:
    return Digest.parse(text) if text else None


def tag_json(t: TagRecord) -> dict[str, Any]:
    return {"repository": t.repository, "tag": t.tag, "digest": str(t.digest),
            "updated_at": t.updated_at.isoformat()}


def tag_record(d: Mapping[str, Any]) -> TagRecord:
    return TagRecord(d["repository"], d["tag"], Digest.parse(d["digest"]),
                     datetime.fromisoformat(d["updated_at"]))


def artifact_json(r: ArtifactRecord) -> dict[str, Any]:
    return {"digest": str(r.digest), "manifest": r.manifest.decode(), "size": r.size,
            "stored_size": r.stored_size, "token_count": r.token_count,
            "model_name": r.model_name, "created_at": r.created_at.isoformat(),
            "repositories": list(r.repositories), "tags": [tag_json(t) for t in r.tags],
            "labels": dict(r.labels),
            "repository_labels": {k: dict(v) for k, v in r.repository_labels.items()},
            "last_used": r.last_used.isoformat() if r.last_used else None,
            "pinned": list(r.pinned)}


def artifact_record(d: Mapping[str, Any]) -> ArtifactRecord:
    return ArtifactRecord(
        Digest.parse(d["digest"]), d["manifest"].encode(), int(d["size"]),
        int(d["stored_size"]), int(d["token_count"]), str(d["model_name"]),
        datetime.fromisoformat(d["created_at"]), tuple(d["repositories"]),
        tuple(tag_record(t) for t in d["tags"]), dict(d["labels"]),
        {str(k): dict(v) for k, v in (d.get("repository_labels") or {}).items()},
        datetime.fromisoformat(d["last_used"]) if d.get("last_used") else None,
        tuple(str(r) for r in d.get("pinned") or ()))


def blob_json(b: BlobRecord) -> dict[str, Any]:
    return {"digest": str(b.digest), "size": b.size, "stored_size": b.stored_size,
            "codec": b.codec}


def blob_record(d: Mapping[str, Any]) -> BlobRecord:
    return BlobRecord(Digest.parse(d["digest"]), int(d["size"]), int(d["stored_size"]),
                      str(d["codec"]))


def event_json(e: EventRecord) -> dict[str, Any]:
    return {"id": e.id, "at": e.at.isoformat() if e.at else None, "action": e.action,
            "actor": e.actor, "host": e.host, "outcome": e.outcome,
            "repository": e.repository, "tag": e.tag,
            "digest": str(e.digest) if e.digest else None, "detail": dict(e.detail)}


def event_record(d: Mapping[str, Any]) -> EventRecord:
    return EventRecord(action=d["action"], actor=d["actor"], host=d["host"],
                       outcome=d["outcome"], repository=d["repository"], tag=d["tag"],
                       digest=_digest(d["digest"]), detail=dict(d["detail"]),
                       at=_time(d["at"]), id=d["id"])


def attestation_json(a: AttestationRecord) -> dict[str, Any]:
    return {"artifact": str(a.artifact), "predicate_type": a.predicate_type,
            "statement": a.statement.decode(),
            "envelope": a.envelope.decode() if a.envelope is not None else None,
            "keyid": a.keyid, "created_at": a.created_at.isoformat() if a.created_at else None,
            "id": a.id}


def attestation_record(d: Mapping[str, Any]) -> AttestationRecord:
    envelope = d.get("envelope")
    return AttestationRecord(Digest.parse(d["artifact"]), str(d["predicate_type"]),
                             str(d["statement"]).encode(),
                             envelope.encode() if envelope is not None else None,
                             d.get("keyid"), _time(d.get("created_at")), d.get("id"))


def chain_report(d: Mapping[str, Any]) -> ChainReport:
    head = d.get("head")
    return ChainReport(int(d["events"]), (int(head["seq"]), str(head["hash"])) if head else None,
                       tuple(ChainProblem(p["seq"], p["kind"], p["message"])
                             for p in d["problems"]))


def malformed(what: str, e: Exception) -> IntegrityError:
    return IntegrityError(f"the server's answer to {what} is malformed: {e!r}",
                          hint="is the server a kvgraft of the same version?")

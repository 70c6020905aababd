"""The catalog of a `kvgraft serve` remote, seen through its /kvgraft/v1/ API: the methods
of kvgraft.catalog.Catalog that Registry calls, so every command runs unchanged over HTTP.

The server decides what each token may see and do, and records every event itself under
the token's name: the actor and host of an EventRecord handed in here are never sent, only
what the event is about. Blob rows are never sent either: the server derives them from the
blobs it holds and verified."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from kvgraft.catalog.events import ChainReport
from kvgraft.catalog.records import (
    ArtifactRecord,
    AttestationRecord,
    BlobRecord,
    EventRecord,
    PushOutcome,
    PushRecord,
    TagRecord,
)
from kvgraft.catalog.usage import Quota, UsageReport
from kvgraft.digest import Digest
from kvgraft.errors import NotFound
from kvgraft.reference import Reference
from kvgraft.remote import wire
from kvgraft.remote.transport import JsonApi

if TYPE_CHECKING:  # gc's module loads the SQL catalog: only a gc needs it
    from kvgraft.transfer.gc import GcPlan, GcResult

API = "/kvgraft/v1"
T = TypeVar("T")


def _about(event: EventRecord | None) -> dict[str, Any]:
    """What an event says, without who: the server fills in the actor and host."""
    if event is None:
        return {}
    return {"action": event.action, "outcome": event.outcome,
            "repository": event.repository, "tag": event.tag,
            "digest": str(event.digest) if event.digest else None,
            "detail": dict(event.detail)}


class HttpCatalog:
    def __init__(self, remote: JsonApi) -> None:
        self.remote = remote
        self.url = remote.url

    def _get(self, path: str, what: str, parse: Callable[[Any], T], **query: Any) -> T:
        q = urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        answer = self.remote.send("GET", f"{API}/{path}" + (f"?{q}" if q else ""), what=what)
        return self._parse(answer, what, parse)

    def _post(self, path: str, body: Mapping[str, Any], what: str,
              parse: Callable[[Any], T]) -> T:
        return self._parse(self.remote.send("POST", f"{API}/{path}", dict(body), what=what),
                           what, parse)

    @staticmethod
    def _parse(answer: Any, what: str, parse: Callable[[Any], T]) -> T:
        try:
            return parse(answer)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise wire.malformed(what, e) from None

    def close(self) -> None:
        self.remote.close()  # the kept-alive connections; a later request opens new ones

    # --- reads -------------------------------------------------------------------------

    def resolve(self, ref: Reference) -> Digest:
        return self._get("resolve", f"resolve {ref}", lambda a: Digest.parse(a["digest"]),
                         ref=str(ref))

    def artifact(self, digest: Digest, repository: str | None = None) -> ArtifactRecord:
        return self._get(f"record/{digest}", f"artifact {digest}",
                         lambda a: wire.artifact_record(a["artifact"]), repository=repository)

    def has_artifact(self, digest: Digest) -> bool:
        try:
            self.artifact(digest)
        except NotFound:
            return False
        return True

    def list_tags(self, pattern: str | None = None, *,
                  problems: list[str] | None = None) -> tuple[TagRecord, ...]:
        def parse(a: Any) -> tuple[TagRecord, ...]:
            if problems is not None:
                problems.extend(str(p) for p in a["problems"])
            return tuple(wire.tag_record(t) for t in a["tags"])

        return self._get("tags", "list tags", parse, pattern=pattern)

    def blob_records(self, digests: Iterable[Digest]) -> dict[Digest, BlobRecord]:
        def parse(a: Any) -> dict[Digest, BlobRecord]:
            records = [wire.blob_record(b) for b in a["blobs"]]
            return {r.digest: r for r in records}

        return self._post("blob-records", {"digests": [str(d) for d in digests]},
                          "blob records", parse)

    def artifact_digests(self) -> list[Digest]:
        return self._get("artifact-digests", "list artifacts",
                         lambda a: [Digest.parse(d) for d in a["digests"]])

    def events(self, *, digest: Digest | None = None, action: str | None = None,
               since: datetime | None = None, limit: int | None = None) -> list[EventRecord]:
        return self._get("events", "the event log",
                         lambda a: [wire.event_record(e) for e in a["events"]],
                         digest=str(digest) if digest else None, action=action,
                         since=since.isoformat() if since else None, limit=limit)

    def attestations(self, digest: Digest,
                     predicate_type: str | None = None) -> list[AttestationRecord]:
        return self._get(f"attestations/{digest}", f"attestations of {digest}",
                         lambda a: [wire.attestation_record(x) for x in a["attestations"]],
                         predicate_type=predicate_type)

    def attestation_digests(self, digest: Digest) -> dict[int, str]:
        return self._get(f"attestations/{digest}", f"attestations of {digest}",
                         lambda a: {int(k): str(v) for k, v in a["recorded"].items()})

    def children(self, digest: Digest) -> list[Digest]:
        return self._get(f"children/{digest}", f"children of {digest}",
                         lambda a: [Digest.parse(d) for d in a["children"]])

    def event_chain(self) -> ChainReport:
        return self._get("event-chain", "the event log's chain",
                         lambda a: wire.chain_report(a["chain"]))

    def event_trigger_problems(self) -> list[str]:
        return self._get("event-chain", "the event log's chain",
                         lambda a: [str(p) for p in a["trigger_problems"]])

    def usage(self, pattern: str | None = None) -> UsageReport:
        """The server's figures for the repositories this token may pull."""
        return self._get("stats", "repository statistics", UsageReport.from_json,
                         pattern=pattern)

    def deleted_blobs(self, digests: Iterable[Digest]) -> set[Digest]:
        # The server checks its own gc history when it commits a push (see record_push).
        return set()

    # --- writes ------------------------------------------------------------------------

    def record_push(self, push: PushRecord) -> PushOutcome:
        """Commit a push whose blobs were uploaded; the server re-derives the blob rows
        from what it holds and refuses a manifest naming blobs it lacks."""
        body = {"manifest": push.manifest.canonical().decode(),
                "repository": push.repository, "tag": push.tag,
                "labels": dict(push.labels), "event": _about(push.event)}
        return self._post("push", body, f"push to {push.repository}",
                          lambda a: PushOutcome(bool(a["created"]),
                                                Digest.parse(a["previous"])
                                                if a["previous"] else None,
                                                tuple(Digest.parse(str(d))
                                                      for d in a.get("evicted") or ())))

    def refresh_blobs(self, blobs: Iterable[BlobRecord]) -> None:
        # Blob rows are the server's: it refreshes them itself when it stores a blob.
        pass

    def set_tag(self, repository: str, tag: str, digest: Digest,
                event: EventRecord) -> Digest | None:
        body = {"repository": repository, "tag": tag, "digest": str(digest),
                "event": _about(event)}
        return self._post("tag", body, f"tag {repository}:{tag}",
                          lambda a: Digest.parse(a["previous"]) if a["previous"] else None)

    def remove_tag(self, repository: str, tag: str, event: EventRecord) -> Digest:
        body = {"repository": repository, "tag": tag, "event": _about(event)}
        return self._post("untag", body, f"untag {repository}:{tag}",
                          lambda a: Digest.parse(a["digest"]))

    def pin(self, repository: str, digest: Digest, pinned: bool,
            event: EventRecord) -> None:
        body = {"repository": repository, "digest": str(digest), "pinned": pinned,
                "tag": event.tag, "event": _about(event)}
        self._post("pin", body, f"{'pin' if pinned else 'unpin'} {repository}@{digest}",
                   lambda a: None)

    def set_quota(self, repository: str, max_bytes: int | None,
                  event: EventRecord) -> int | None:
        body = {"repository": repository, "max_bytes": max_bytes, "event": _about(event)}
        return self._post("quotas", body, f"set the quota of {repository}",
                          lambda a: None if a["previous"] is None else int(a["previous"]))

    def quotas(self) -> list[Quota]:
        return self._get("quotas", "quotas",
                         lambda a: [Quota.from_json(q) for q in a["quotas"]])

    def gc_plan(self, *, grace: float, untagged_older_than: float | None,
                unused_for: float | None) -> GcPlan:
        """The server's gc plan of its own catalog and store (admin on every repository)."""
        from kvgraft.transfer.gc import GcPlan

        body = {"grace": grace, "untagged_older_than": untagged_older_than,
                "unused_for": unused_for, "dry_run": True}
        return self._post("gc", body, "plan a gc", lambda a: GcPlan.from_json(a["plan"]))

    def gc(self, plan: GcPlan, *, allow_empty_catalog: bool) -> GcResult:
        """A gc on the server with `plan`'s settings; the server plans again as it runs
        (what changed since `plan` was printed counts)."""
        from kvgraft.transfer.gc import GcResult

        body = {"grace": plan.grace, "untagged_older_than": plan.untagged_older_than,
                "unused_for": plan.unused_for, "dry_run": False,
                "allow_empty_catalog": allow_empty_catalog}
        return self._post("gc", body, "gc", GcResult.from_json)

    def add_event(self, event: EventRecord) -> None:
        self._post("events", _about(event), f"record a {event.action} event", lambda a: None)

    def add_attestation(self, att: AttestationRecord,
                        event: EventRecord | None = None) -> int:
        body = {"attestation": wire.attestation_json(att), "event": _about(event)}
        return self._post("attestations", body, f"attest {att.artifact}",
                          lambda a: int(a["id"]))

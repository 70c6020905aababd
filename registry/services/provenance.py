"""Where an artifact came from and who vouches for it: its provenance statement, stored
attestations, signatures with this machine's keys, and the audit that checks them all."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvgraft.catalog.records import AttestationRecord
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError
from kvgraft.reference import Reference

if TYPE_CHECKING:
    from kvgraft.provenance import Statement
    from kvgraft.provenance.audit import AuditReport
    from kvgraft.services.backends import Backends
    from kvgraft.services.events import EventLog
    from kvgraft.services.manifests import Manifests
    from kvgraft.services.policy import Policy


class Provenance:
    def __init__(self, backends: Backends, manifests: Manifests, policy: Policy,
                 events: EventLog) -> None:
        self.backends = backends
        self.manifests = manifests
        self.policy = policy
        self.events = events

    def statement(self, ref: Reference | str,
                  ) -> tuple[Statement, tuple[AttestationRecord, ...]]:
        """The kvgraft provenance statement of the artifact `ref` names (derived from its
        manifest and first push), and the attestations stored about it."""
        from kvgraft.provenance import Statement, provenance_statement
        from kvgraft.provenance.audit import origin

        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        digest = self.backends.resolve(ref)
        manifest = self.manifests.from_catalog(digest)
        catalog = self.backends.catalog
        statement = provenance_statement(manifest, origin(catalog.events(digest=digest)),
                                         name=ref.name)
        attestations = tuple(catalog.attestations(digest))
        for a in attestations:
            try:  # validated on read, like everything kvgraft hands out
                Statement.parse(a.statement)
            except IntegrityError as e:
                raise IntegrityError(f"attestation {a.id} of {digest} is invalid: {e.message}",
                                     hint="`kvgraft audit` shows every problem") from None
        return statement, attestations

    def sign(self, ref: Reference | str, key: str) -> tuple[Digest, str, int]:
        """Sign the provenance statement of `ref` with the keyring's key `key`; stores the
        DSSE envelope as an attestation. Returns (digest, keyid, attestation id)."""
        from kvgraft.provenance import PROVENANCE, sign_statement

        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        signer = self.policy.keyring.signer(key)
        statement, _ = self.statement(ref)
        digest = statement.subjects[0].digest
        keyid: str = signer.public_key.keyid
        envelope = sign_statement(statement, signer)
        att = AttestationRecord(digest, PROVENANCE, statement.canonical(), envelope, keyid)
        event = self.events.event("sign", repository=ref.name, tag=ref.tag, digest=digest,
                                  detail={"keyid": keyid, "key": key,
                                          "predicate_type": PROVENANCE,
                                          "statement_digest": str(statement.digest)})
        return digest, keyid, self.backends.catalog.add_attestation(att, event)

    def attest(self, statement: Statement, *, event_action: str = "attest",
               detail: Mapping[str, Any] | None = None,
               reference: Reference | None = None) -> int:
        """Store an (unsigned) statement about its subject artifact, with its event."""
        digest = statement.subjects[0].digest
        return self.attest_bytes(digest, statement.predicate_type, statement.canonical(),
                                 event_action=event_action, detail=detail,
                                 reference=reference)

    def attest_bytes(self, digest: Digest, predicate_type: str, body: bytes, *,
                     event_action: str = "attest", detail: Mapping[str, Any] | None = None,
                     reference: Reference | None = None) -> int:
        """Store the canonical statement `body` about `digest`, with its event."""
        att = AttestationRecord(digest, predicate_type, body)
        event = self.events.event(event_action, digest=digest,
                                  repository=reference.name if reference else None,
                                  tag=reference.tag if reference else None, detail={
                                      **(detail or {}), "predicate_type": predicate_type,
                                      "statement_digest": str(att.statement_digest)})
        return self.backends.catalog.add_attestation(att, event)

    def audit(self, ref: Reference | str, *, workers: int | None = None) -> AuditReport:
        from kvgraft.provenance.audit import audit

        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        digest = self.backends.resolve(ref)
        return audit(self.backends.catalog, self.backends.blobs(ref.name, digest), digest,
                     self.policy.keyring.trusted(), workers=workers)

"""Checking stored attestations, and the policies pull and load enforce with them.

Every check fails closed: an attestation counts only when its stored statement still
hashes to the digest recorded beside it, parses and passes its schemas, names the artifact
as its subject, and (when signed) carries exactly that statement in an envelope whose
signature verifies under a key in the trust store. Refusals are `PolicyRefused`, an
IntegrityError (exit 4) whose message says what was required and what was found.

Config defaults live in $KVGRAFT_HOME/config.toml:

    [policy]
    require_signed_by = ["<keyid or key name>", ...]   # any one of these keys
    require_verified = true
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from kvgraft.catalog.records import AttestationRecord, EventRecord
from kvgraft.configfile import config_path, load_document
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, UsageError
from kvgraft.identity.model import ModelIdentity
from kvgraft.provenance.keys import Keyring, PublicKey
from kvgraft.provenance.signing import open_envelope
from kvgraft.provenance.statement import FIDELITY, Statement, fidelity_identity


class PolicyRefused(IntegrityError):
    """An artifact that the configured policy does not accept."""


class AttestationSource(Protocol):
    """What the checks read (the Catalog provides it)."""

    def attestations(self, digest: Digest,
                     predicate_type: str | None = None) -> list[AttestationRecord]: ...

    def attestation_digests(self, digest: Digest) -> dict[int, str]: ...

    def events(self, *, digest: Digest | None = None, action: str | None = None,
               since: datetime | None = None, limit: int | None = None,
               ) -> list[EventRecord]: ...


@dataclass(frozen=True, slots=True)
class AttestationStatus:
    id: int | None
    predicate_type: str
    keyid: str | None
    signed: bool
    signers: tuple[str, ...] = ()  # trusted keys whose signature verified
    problems: tuple[str, ...] = ()
    statement: Statement | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "predicate_type": self.predicate_type, "keyid": self.keyid,
                "signed": self.signed, "signers": list(self.signers), "ok": self.ok,
                "problems": list(self.problems)}


def assess(att: AttestationRecord, stored_digest: str | None, artifact: Digest,
           trusted: Mapping[str, PublicKey] | None,
           anchors: Set[str] | None = None) -> AttestationStatus:
    """Every way a stored attestation fails to be what it claims. With `trusted` None the
    signature's trust is not judged (only that the envelope carries this statement).
    `anchors` are the statement digests the (hash-chained) event log recorded when
    attestations were stored: a statement missing there was added or edited behind the
    library's back, even if whoever did it also rewrote the digest beside it."""
    problems: list[str] = []
    signed = att.envelope is not None
    if stored_digest is not None and stored_digest != str(att.statement_digest):
        problems.append("statement was changed in the catalog (it no longer hashes to the "
                        "digest recorded with it)")
    elif anchors is not None and str(att.statement_digest) not in anchors:
        problems.append("statement is not the one the event log recorded when attestations "
                        "were stored (added or edited behind the library's back)")
    statement = None
    try:
        statement = Statement.parse(att.statement)
    except IntegrityError as e:
        problems.append(e.message)
    if statement is not None:
        if not statement.names(artifact):
            subjects = ", ".join(str(s.digest) for s in statement.subjects)
            problems.append(f"statement is about {subjects}, not {artifact}")
        if statement.predicate_type != att.predicate_type:
            problems.append(f"recorded as {att.predicate_type} but the statement says "
                            f"{statement.predicate_type}")
    signers: tuple[str, ...] = ()
    if att.envelope is not None:
        try:
            opened = open_envelope(att.envelope, trusted or {})
        except IntegrityError as e:
            problems.append(f"envelope: {e.message}")
        else:
            signers = opened.signers
            if opened.payload != att.statement:
                problems.append("signed payload differs from the stored statement")
            if att.keyid is not None and att.keyid not in {c.keyid for c in opened.checks}:
                problems.append(f"recorded signer {att.keyid[:16]} did not sign the envelope")
            if not signers and trusted is not None:
                problems.extend(c.reason for c in opened.checks)
    return AttestationStatus(att.id, att.predicate_type, att.keyid, signed, signers,
                             tuple(problems), statement)


def assess_all(source: AttestationSource, digest: Digest,
               trusted: Mapping[str, PublicKey] | None,
               predicate_type: str | None = None) -> list[AttestationStatus]:
    stored = source.attestation_digests(digest)
    anchors = {str(e.detail["statement_digest"]) for e in source.events(digest=digest)
               if "statement_digest" in e.detail}
    return [assess(a, stored.get(a.id) if a.id is not None else None, digest, trusted,
                   anchors) for a in source.attestations(digest, predicate_type)]


def _describe(statuses: Iterable[AttestationStatus]) -> str:
    parts = [f"attestation {s.id}: {'; '.join(s.problems) if s.problems else 'ok'}"
             for s in statuses]
    return "; ".join(parts) if parts else "it has no attestations"


def require_signed_by(source: AttestationSource, digest: Digest, keyids: Sequence[str],
                      trusted: Mapping[str, PublicKey]) -> str:
    """Refuse `digest` unless an intact attestation is signed by one of `keyids` (each a
    key in the trust store); returns the keyid that signed."""
    if not keyids:
        raise UsageError("require_signed_by needs at least one keyid")
    untrusted = [k for k in keyids if k not in trusted]
    if len(untrusted) == len(keyids):
        raise PolicyRefused(f"policy requires a signature by {', '.join(k[:16] for k in keyids)}"
                            f", but no such key is in the trust store",
                            hint="add the key with `kvgraft trust add FILE`")
    statuses = [s for s in assess_all(source, digest, trusted) if s.signed]
    for s in statuses:
        hit = next((k for k in s.signers if k in keyids), None)
        if s.ok and hit is not None:
            return hit
    wanted = " or ".join(k[:16] for k in keyids if k in trusted)
    raise PolicyRefused(f"{digest} has no valid signature by {wanted}: "
                        + (_describe(statuses) if statuses else "it is not signed"))


def _identity_mismatch(want: ModelIdentity, got: ModelIdentity) -> list[str]:
    return [f for f in ("architecture", "tokenizer", "weights")
            if getattr(want, f) != getattr(got, f)]


def require_verified(source: AttestationSource, digest: Digest,
                     identity: ModelIdentity) -> AttestationStatus:
    """Refuse `digest` unless an intact fidelity attestation says a check on the model
    `identity` passed. The loader calls this with the live model's identity."""
    # Who signed a fidelity result is require_signed_by's question, not this one's.
    statuses = assess_all(source, digest, None, FIDELITY)
    found = []
    for s in statuses:
        if not s.ok or s.statement is None:
            found.append(f"attestation {s.id}: {'; '.join(s.problems)}")
            continue
        mismatch = _identity_mismatch(identity, fidelity_identity(s.statement))
        if mismatch:
            found.append(f"attestation {s.id} is for another model ({', '.join(mismatch)} "
                         "differ)")
        elif s.statement.predicate.get("passed") is not True:
            found.append(f"attestation {s.id} records a failed check")
        else:
            return s
    raise PolicyRefused(f"{digest} has no successful fidelity attestation for model "
                        f"{identity.key.short}: "
                        + ("; ".join(found) if found else "it was never verified"),
                        hint="run `kvgraft verify-graft` on that model")


@dataclass(frozen=True, slots=True)
class Policy:
    require_signed_by: tuple[str, ...] = field(default_factory=tuple)  # keyids, any one
    require_verified: bool = False


def load_policy(home: Path, keyring: Keyring | None = None) -> Policy:
    """The [policy] table of config.toml; key names there are resolved to keyids."""
    raw = load_document(home).get("policy", {})
    where = f"{config_path(home)}: [policy]"
    if not isinstance(raw, dict):
        raise UsageError(f"{where} must be a table")
    unknown = set(raw) - {"require_signed_by", "require_verified"}
    if unknown:
        raise UsageError(f"{where} has unknown keys {sorted(unknown)}",
                         hint="allowed: require_signed_by, require_verified")
    signed = raw.get("require_signed_by", [])
    if isinstance(signed, str):
        signed = [signed]
    if not isinstance(signed, list) or not all(isinstance(k, str) for k in signed):
        raise UsageError(f"{where} require_signed_by must be a list of keyids")
    verified = raw.get("require_verified", False)
    if not isinstance(verified, bool):
        raise UsageError(f"{where} require_verified must be true or false")
    keyring = keyring or Keyring(home)
    return Policy(tuple(keyring.resolve(k) for k in signed), verified)

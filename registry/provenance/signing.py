"""DSSE envelopes over in-toto statements, signed and verified with securesystemslib.

The envelope is the standard JSON form (`payload` base64 of the statement's canonical
JSON, `payloadType` application/vnd.in-toto+json, `signatures` [{keyid, sig}]); the
signature is Ed25519 over DSSE's pre-authentication encoding. securesystemslib does the
encoding and the cryptography, so what kvgraft writes is what other DSSE tools read.
"""

from __future__ import annotations

import binascii
import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass

from securesystemslib import exceptions as sslib_errors
from securesystemslib.dsse import Envelope
from securesystemslib.signer import Signer

from kvgraft import strictjson
from kvgraft.digest import canonical_json
from kvgraft.errors import IntegrityError
from kvgraft.provenance.keys import PublicKey
from kvgraft.provenance.statement import PAYLOAD_TYPE, Statement


def sign_statement(statement: Statement, signer: Signer) -> bytes:
    """The envelope (canonical JSON) carrying `statement` signed by `signer`."""
    envelope = Envelope(statement.canonical(), PAYLOAD_TYPE, {})
    envelope.sign(signer)
    return canonical_json(envelope.to_dict())


@dataclass(frozen=True, slots=True)
class SignatureCheck:
    keyid: str
    valid: bool  # verified under a trusted key
    reason: str  # why not, or "ok"


@dataclass(frozen=True, slots=True)
class OpenedEnvelope:
    statement: Statement
    payload: bytes
    checks: tuple[SignatureCheck, ...]

    @property
    def signers(self) -> tuple[str, ...]:
        """Keyids of trusted keys whose signature verified."""
        return tuple(c.keyid for c in self.checks if c.valid)


def parse_envelope(raw: bytes) -> Envelope:
    try:
        data = strictjson.loads(raw)
        # from_dict rewrites the signature dicts it is given; keep the caller's intact.
        envelope = Envelope.from_dict(copy.deepcopy(data))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
            AttributeError, binascii.Error, sslib_errors.FormatError) as e:
        raise IntegrityError(f"malformed DSSE envelope: {type(e).__name__}: {e}") from None
    if envelope.payload_type != PAYLOAD_TYPE:
        raise IntegrityError(f"envelope payload type is {envelope.payload_type!r}, "
                             f"not {PAYLOAD_TYPE!r}")
    return envelope


def open_envelope(raw: bytes, trusted: Mapping[str, PublicKey]) -> OpenedEnvelope:
    """Parse an envelope, check every signature against the trusted keys, and parse the
    statement it carries. A signature from a key not in `trusted` is reported, never used."""
    envelope = parse_envelope(raw)
    if not envelope.signatures:
        raise IntegrityError("envelope carries no signature")
    pae = envelope.pae()
    checks = []
    for keyid, sig in envelope.signatures.items():
        key = trusted.get(keyid)
        if key is None:
            checks.append(SignatureCheck(keyid, False, f"key {keyid[:16]} is not trusted"))
            continue
        try:
            key.sslib().verify_signature(sig, pae)
        except (sslib_errors.UnverifiedSignatureError, sslib_errors.VerificationError):
            checks.append(SignatureCheck(keyid, False,
                                         f"signature by {keyid[:16]} does not verify"))
            continue
        checks.append(SignatureCheck(keyid, True, "ok"))
    return OpenedEnvelope(Statement.parse(envelope.payload), envelope.payload, tuple(checks))

"""Provenance: in-toto statements about artifacts, DSSE signatures with Ed25519 keys, the
trust store, and the policies pull and load enforce with them."""

from kvgraft.provenance.keys import Keyring, PublicKey
from kvgraft.provenance.policy import (
    AttestationStatus,
    Policy,
    PolicyRefused,
    load_policy,
    require_signed_by,
    require_verified,
)
from kvgraft.provenance.signing import open_envelope, sign_statement
from kvgraft.provenance.statement import (
    FIDELITY,
    PAYLOAD_TYPE,
    PROVENANCE,
    Origin,
    Statement,
    fidelity_statement,
    provenance_statement,
)

__all__ = [
    "FIDELITY",
    "PAYLOAD_TYPE",
    "PROVENANCE",
    "AttestationStatus",
    "Keyring",
    "Origin",
    "Policy",
    "PolicyRefused",
    "PublicKey",
    "Statement",
    "fidelity_statement",
    "load_policy",
    "open_envelope",
    "provenance_statement",
    "require_signed_by",
    "require_verified",
    "sign_statement",
]

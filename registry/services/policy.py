"""The policy every artifact passes before it is used: the signatures and verifications
the caller asks for, added to the [policy] table of config.toml."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvgraft.digest import Digest
from kvgraft.identity.model import ModelIdentity
from kvgraft.reference import Reference

if TYPE_CHECKING:
    from kvgraft.formats.manifest import Manifest
    from kvgraft.provenance import Keyring
    from kvgraft.services.backends import Backends
    from kvgraft.services.events import EventLog


def as_reference(ref: Reference | Digest | str) -> Reference | None:
    if isinstance(ref, Digest):
        return None
    return Reference.parse(ref) if isinstance(ref, str) else ref


class Policy:
    def __init__(self, backends: Backends, events: EventLog) -> None:
        self.backends = backends
        self.events = events
        self._keyring: Keyring | None = None

    @property
    def keyring(self) -> Keyring:
        if self._keyring is None:
            from kvgraft.provenance import Keyring

            self._keyring = Keyring(self.backends.config.home)
        return self._keyring

    def check(self, ref: Reference | Digest | str, manifest: Manifest, *,
              require_signed_by: Sequence[str] = (), require_verified: bool = False,
              model: ModelIdentity | None = None, for_verification: bool = False,
              action: str = "load") -> None:
        """Refuse the artifact of `manifest` (named by `ref`) unless the policy accepts it:
        `require_signed_by` (keyids or key names, any one) and `require_verified` add to
        the [policy] table of config.toml. A verification must be for `model` (the live
        model) when given, else for the graft's own model. `for_verification` marks the
        fidelity check itself: it is what produces a verification, so require_verified
        does not apply to it (a signature requirement still does). A refusal is
        PolicyRefused (exit 4), recorded as an `action` event with outcome "refused"."""
        from kvgraft.configfile import load_document

        if not require_signed_by and not require_verified and \
                not load_document(self.backends.config.home).get("policy"):
            return  # nothing to enforce: the signature machinery need not even load
        from kvgraft.provenance import load_policy

        policy = load_policy(self.backends.config.home, self.keyring)
        keyids = (tuple(self.keyring.resolve(k) for k in require_signed_by)
                  or policy.require_signed_by)
        wanted = (require_verified or policy.require_verified) and not for_verification
        identity = (model or manifest.model) if wanted else None
        if keyids or identity is not None:
            self._enforce(as_reference(ref), manifest.digest, keyids, identity, action)

    def _enforce(self, reference: Reference | None, digest: Digest, keyids: Sequence[str],
                 identity: ModelIdentity | None, action: str) -> None:
        from kvgraft.provenance import PolicyRefused
        from kvgraft.provenance import require_signed_by as signed_check
        from kvgraft.provenance import require_verified as verified_check

        catalog = self.backends.policy_catalog(str(reference or digest))
        try:
            if keyids:
                signed_check(catalog, digest, keyids, self.keyring.trusted())
            if identity is not None:
                verified_check(catalog, digest, identity)
        except PolicyRefused as e:
            self.events.record(action, repository=reference.name if reference else None,
                               tag=reference.tag if reference else None, digest=digest,
                               outcome="refused", detail={"reason": e.message})
            raise

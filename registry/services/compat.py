"""Admitting a graft into a live model: its identity compared with the model's, refused on
any mismatch unless forced, and a forced load logged and recorded in the audit log (action
"force-incompatible"). One rule for every engine that loads grafts."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvgraft.digest import Digest
from kvgraft.formats.manifest import Manifest
from kvgraft.identity.compat import CompatReport, compare
from kvgraft.identity.fingerprint import Fingerprint
from kvgraft.reference import Reference

if TYPE_CHECKING:
    from kvgraft.services.events import EventLog

_log = logging.getLogger(__name__)


def admit(events: EventLog, reference: Reference, digest: Digest, manifest: Manifest,
          fingerprint: Fingerprint, *, force_incompatible: bool,
          log: logging.Logger | None = None) -> CompatReport:
    """The report of `manifest`'s model against `fingerprint`; raises IncompatibleModel
    on a mismatch unless `force_incompatible`, which is warned about and audited."""
    report = compare(manifest.model, manifest.model_config, fingerprint)
    if report.ok:
        return report
    if not force_incompatible:
        raise report.error(f"graft {reference}")
    (log or _log).warning("FORCED: loading %s into an incompatible model: %s", reference,
                          "; ".join(m.human() for m in report.mismatches))
    events.record("force-incompatible", repository=reference.name, tag=reference.tag,
                  digest=digest, outcome="forced",
                  detail={"model": fingerprint.identity.to_json(),
                          "mismatches": [m.to_json() for m in report.mismatches]})
    return report

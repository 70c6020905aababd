"""Whether what the registry holds is what it says: every blob re-read and hashed against
its digest (`verify`), bad blobs replaced with good bytes (`repair`), and tags checked to
lead somewhere (`verify_tags`). Each verification and repair is an event."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError
from kvgraft.reference import Reference

if TYPE_CHECKING:
    from kvgraft.services.backends import Backends
    from kvgraft.services.events import EventLog
    from kvgraft.services.manifests import Manifests
    from kvgraft.transfer.verify import VerifyReport

REPAIR_ELSEWHERE = ("run `kvgraft verify REF --repair` on the server's host with a direct "
                    "remote, or push the file again through the server (a push replaces "
                    "blobs that no longer verify)")


class Integrity:
    def __init__(self, backends: Backends, manifests: Manifests, events: EventLog) -> None:
        self.backends = backends
        self.manifests = manifests
        self.events = events

    def verify(self, ref: Reference | str | None = None, *, workers: int | None = None,
               ) -> tuple[VerifyReport, ...]:
        digests = ([self.backends.resolve(Reference.parse(ref) if isinstance(ref, str) else ref)]
                   if ref is not None else self.backends.catalog.artifact_digests())
        reports = []
        for digest in digests:
            report = self._verify_one(digest, workers)
            reports.append(report)
            self.events.record("verify", digest=digest, outcome="ok" if report.ok else "failed",
                               detail={"checked": report.checked,
                                       "bad": [str(b.digest) for b in report.bad],
                                       "problems": list(report.problems)})
        return tuple(reports)

    def _verify_one(self, digest: Digest, workers: int | None) -> VerifyReport:
        from kvgraft.transfer.verify import VerifyReport, verify_artifact

        try:  # a tampered manifest is reported with the rest, never ends the run
            manifest = self.manifests.from_catalog(digest)
        except IntegrityError as e:
            return VerifyReport(digest, 0, 0, (), (e.message,))
        records = self.backends.catalog.blob_records(b.digest for b in manifest.blobs())
        return verify_artifact(manifest, self.backends.blobs(None, digest), records,
                               workers=workers)

    def repair(self, report: VerifyReport, source: Path | None = None) -> Sequence[Digest]:
        """Replace the bad blobs of a failed verification with good bytes from `source`
        (the pushed KV file) or the cache; returns the digests that could not be repaired
        (verify again to see the outcome)."""
        from kvgraft.transfer import repair

        store = self.backends.whole_store("repairing blobs", REPAIR_ELSEWHERE)
        manifest = self.manifests.from_catalog(report.artifact)
        bad = [b.digest for b in report.bad]
        left: Sequence[Digest] = ()
        if source is not None:
            fixed = repair.from_file(manifest, source, store)
        else:
            fixed, left = repair.from_cache(manifest, bad, store, self.backends.cache)
        self.backends.catalog.refresh_blobs(fixed)
        self.events.record("repair", digest=report.artifact,
                           outcome="ok" if not left else "failed",
                           detail={"source": str(source) if source else "cache",
                                   "repaired": [str(d) for d in bad if d not in left],
                                   "unrepaired": [str(d) for d in left]})
        return left

    def verify_tags(self) -> tuple[str, ...]:
        """Every tag that does not lead to an artifact: a malformed digest, or one the
        catalog holds no artifact for (the foreign key can be switched off in SQLite)."""
        catalog = self.backends.catalog
        problems: list[str] = []
        known = set(catalog.artifact_digests())
        for t in catalog.list_tags(problems=problems):
            if t.digest not in known:
                problems.append(f"tag {t.repository}:{t.tag} points at {t.digest}, which is "
                                "not in the catalog")
        return tuple(problems)

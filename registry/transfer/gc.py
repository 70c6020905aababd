"""Garbage collection: plan, then execute; safe while other machines push.

What is kept: every artifact a repository pins; every tagged artifact, unless it has not
been used for `unused_for` (a use: a restore, pull or match; its push counts as one;
kvgraft.catalog.lifecycle), when that is given: tags do not protect what nobody uses, pins
do; every untagged artifact younger than the retention (`untagged_older_than`) and not
unused for `unused_for` (without either, no artifact is deleted); every ancestor (manifest
parents, recursively) of a kept artifact, so lineage stays auditable; every blob a kept
artifact references; every blob whose stored object is younger than the grace period.
gc fails closed: when an artifact's manifest in the catalog cannot be read (or no longer
hashes to its digest), its ancestors are unknown, so a plan that would delete any artifact
is refused, naming it, and nothing is deleted. Without a retention no artifact is deleted
and blobs are kept through the catalog's blob links, so such a plan still runs.
Everything else is planned for deletion: untagged artifacts past the retention, then the
blobs that only they referenced or that no artifact ever referenced (pushes that died).

The race, and why this is safe. A push stores its blobs first and commits the catalog at
the end; a blob already in the store is not uploaded again. So a push P can find blob b
present (it belongs to an artifact gc is deleting), skip it, and commit an artifact that
references b after gc decided b was unreferenced and deleted it. The grace period does
not help there (b is old). Three rules close it:

1. gc deletes blobs only inside a catalog transaction that excludes push commits
   (SQLite: the write lock every writer takes; PostgreSQL: SHARE ROW EXCLUSIVE on blobs,
   artifacts and artifact_blobs, which every push commit writes, and on the OCI tables)
   and that re-checks, under that lock, that no artifact references the blob, that no OCI
   manifest put since the plan names it, that no repository linked it inside the grace
   (an upload through `kvgraft serve`), and that the stored object is still older than
   the grace. The store object is deleted while the lock is held. So
   any push either committed before (gc sees the reference and keeps b) or commits after
   the object is already gone.
2. Before that transaction, gc commits a record of every blob it is about to delete
   (`blob_deletions`), so the record exists before any object disappears, whatever
   happens to gc afterwards.
3. After its commit, a push asks the catalog which of its blobs have a deletion record
   (one indexed query) and re-checks just those in the store (`ensure_blobs`); a missing
   one is uploaded again from the pushed file, and its row is made to describe what the
   store now holds. By rule 1 that check runs after every deletion that could have hit
   the push, and by rule 2 it sees them.

Fresh uploads of an in-flight push are unreferenced until it commits: the grace period
keeps them from being planned at all, and rule 3 repairs the push anyway if a gc with a
tiny grace removed them. A push slower than 30 days (the deletion records kept) is not
protected. Artifact deletion re-checks "untagged and past the retention" under the same
lock, so a push or tag that lands first saves its artifact; "unused" is re-checked there
too, so a use recorded after the plan (a restore of the graft gc is about to collect)
saves it. A restore already reading it when it goes fails its verified read of a missing
chunk and computes the prefill instead: never wrong KV.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from kvgraft.blobstore.base import BlobInfo, BlobStore
from kvgraft.blobstore.local import LocalBlobStore
from kvgraft.catalog import BlobRecord, Catalog, EventRecord
from kvgraft.catalog.gcquery import ArtifactLinks
from kvgraft.catalog.oci import OciTables
from kvgraft.digest import Digest
from kvgraft.errors import Conflict, IntegrityError, NotFound, RegistryError, UsageError
from kvgraft.formats.manifest import Manifest
from kvgraft.fsutil import sweep_temp
from kvgraft.transfer.push import existing_record

DEFAULT_GRACE = 24 * 3600.0
SWEEP_BATCH = 128  # blobs per locked transaction: pushes wait at most one batch


@dataclass(frozen=True, slots=True)
class GcPlan:
    now: datetime
    grace: float
    untagged_older_than: float | None
    unused_for: float | None
    artifacts: tuple[Digest, ...]  # to delete
    blobs: tuple[BlobInfo, ...]  # to delete
    kept_artifacts: int
    kept_blobs: int  # referenced by a kept artifact
    young_blobs: int  # unreferenced but inside the grace period

    @property
    def bytes_freed(self) -> int:
        return sum(b.stored_size for b in self.blobs)

    def to_json(self) -> dict[str, Any]:
        return {"planned_at": self.now.isoformat(), "grace_seconds": self.grace,
                "untagged_older_than_seconds": self.untagged_older_than,
                "unused_for_seconds": self.unused_for,
                "artifacts": [str(d) for d in self.artifacts],
                "blobs": [str(b.digest) for b in self.blobs],
                "blob_sizes": [b.stored_size for b in self.blobs],
                "bytes_freed": self.bytes_freed, "kept_artifacts": self.kept_artifacts,
                "kept_blobs": self.kept_blobs, "young_blobs": self.young_blobs}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> GcPlan:
        """A plan a server made and sent (its blobs' times stay on the server)."""
        blobs = tuple(BlobInfo(Digest.parse(str(d)), int(n), 0.0)
                      for d, n in zip(raw["blobs"], raw["blob_sizes"], strict=True))
        return cls(datetime.fromisoformat(raw["planned_at"]), float(raw["grace_seconds"]),
                   _seconds(raw["untagged_older_than_seconds"]),
                   _seconds(raw["unused_for_seconds"]),
                   tuple(Digest.parse(str(d)) for d in raw["artifacts"]), blobs,
                   int(raw["kept_artifacts"]), int(raw["kept_blobs"]), int(raw["young_blobs"]))


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True, slots=True)
class GcResult:
    plan: GcPlan
    artifacts: tuple[Digest, ...]  # deleted
    blobs: tuple[Digest, ...]  # deleted
    bytes_freed: int
    errors: tuple[str, ...] = field(default_factory=tuple)  # blobs the store refused

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": False, "plan": self.plan.to_json(),
                "artifacts_deleted": [str(d) for d in self.artifacts],
                "blobs_deleted": len(self.blobs), "bytes_freed": self.bytes_freed,
                "errors": list(self.errors), "blobs": [str(d) for d in self.blobs]}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> GcResult:
        return cls(GcPlan.from_json(raw["plan"]),
                   tuple(Digest.parse(str(d)) for d in raw["artifacts_deleted"]),
                   tuple(Digest.parse(str(d)) for d in raw["blobs"]),
                   int(raw["bytes_freed"]), tuple(str(e) for e in raw["errors"]))


def plan(catalog: Catalog, store: BlobStore, *, grace: float = DEFAULT_GRACE,
         untagged_older_than: float | None = None, unused_for: float | None = None,
         now: datetime | None = None) -> GcPlan:
    if any(d is not None and d < 0 for d in (grace, untagged_older_than, unused_for)):
        raise UsageError("gc durations must not be negative")
    now = now or datetime.now(UTC)
    arts = catalog.gc_inventory()
    by_digest = {a.digest: a for a in arts}
    cutoff = None if untagged_older_than is None else now - timedelta(
        seconds=untagged_older_than)
    unused = None if unused_for is None else now - timedelta(seconds=unused_for)

    def root(a: ArtifactLinks) -> bool:
        if a.pinned:
            return True
        if unused is not None and a.used_at < unused:
            return False
        return a.tagged or cutoff is None or a.created_at >= cutoff

    roots = {a.digest for a in arts if root(a)}
    keep: set[Digest] = set()
    todo = list(roots)
    while todo:
        d = todo.pop()
        if d in keep or d not in by_digest:
            continue
        keep.add(d)
        todo.extend(by_digest[d].parents or ())
    doomed = tuple(a.digest for a in arts if a.digest not in keep)
    unknown = sorted(a.digest for a in arts if a.parents is None)
    if doomed and unknown:
        _refuse(unknown)
    referenced = {b for d in keep for b in by_digest[d].blobs}
    # Blobs pushed through `kvgraft serve`: those an OCI manifest names, and fresh uploads.
    referenced |= OciTables(catalog).kept_blobs(now - timedelta(seconds=grace))
    blob_cutoff = (now - timedelta(seconds=grace)).timestamp()
    sweep, young = [], 0
    for info in store.iter():
        if info.digest in referenced:
            continue
        if info.mtime >= blob_cutoff:
            young += 1
        else:
            sweep.append(info)
    return GcPlan(now, grace, untagged_older_than, unused_for, doomed, tuple(sweep),
                  len(keep), len(referenced), young)


def _refuse(unknown: list[Digest]) -> None:
    named = ", ".join(str(d) for d in unknown[:5])
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    raise IntegrityError(
        f"gc refused, nothing deleted: the catalog's manifest of artifact {named}{more} is "
        "corrupt (unreadable, or no longer the manifest its digest names), so which "
        "artifacts it descends from, and gc must keep, is unknown",
        hint="`kvgraft audit` on it shows the damage; restore the catalog row from a backup "
             "or a copy of the registry, then run gc again")


def execute(catalog: Catalog, store: BlobStore, gc_plan: GcPlan, event: EventRecord, *,
            allow_empty_catalog: bool = False) -> GcResult:
    """Carry out `gc_plan`; every decision is re-checked under the gc lock (module doc).

    A catalog without a single artifact in front of a store full of old blobs is far more
    often a lost or wrong catalog (a fresh file, a wrong KVGRAFT_CATALOG_URL) than a store
    that really is all garbage, so that sweep needs `allow_empty_catalog`."""
    p = gc_plan
    if p.blobs and not p.artifacts and not p.kept_artifacts and not allow_empty_catalog:
        raise Conflict(
            f"the catalog holds no artifacts but {store.url} holds {len(p.blobs)} old "
            "blob(s); refusing to delete them all",
            hint="check KVGRAFT_CATALOG_URL (a lost catalog is restored from a backup); "
                 "if the store really holds nothing you need, run gc --allow-empty-catalog")
    detail = {**event.detail, "grace_seconds": p.grace,
              "untagged_older_than_seconds": p.untagged_older_than,
              "unused_for_seconds": p.unused_for,
              "blobs_planned": len(p.blobs), "bytes_planned": p.bytes_freed}
    # The event goes in with the artifact deletions, atomically; the blob sweep that
    # follows leaves its own trail in blob_deletions.
    artifacts = catalog.delete_artifacts(
        p.artifacts, event=dataclasses.replace(event, detail=detail),
        created_before=None if p.untagged_older_than is None
        else p.now - timedelta(seconds=p.untagged_older_than),
        unused_before=None if p.unused_for is None
        else p.now - timedelta(seconds=p.unused_for))
    cutoff = (p.now - timedelta(seconds=p.grace)).timestamp()
    sizes = {b.digest: b.stored_size for b in p.blobs}
    freed = 0
    errors: list[str] = []

    def delete_blob(digest: Digest) -> bool:
        nonlocal freed
        try:
            info = store.stat(digest)
            if info is None:
                return True
            if info.mtime >= cutoff:
                return False  # stored again since the plan: a push may be relying on it
            if store.delete(digest):
                freed += sizes.get(digest, info.stored_size)
            return True
        except RegistryError as e:
            errors.append(f"{digest}: {e.message}")
            return False

    deleted: list[Digest] = []
    blobs = [b.digest for b in p.blobs]
    for i in range(0, len(blobs), SWEEP_BATCH):
        deleted += catalog.sweep_blobs(blobs[i:i + SWEEP_BATCH], delete_blob,
                                       planned_at=p.now,
                                       uploaded_after=p.now - timedelta(seconds=p.grace))
    if isinstance(store, LocalBlobStore):  # writers killed mid-put leave their temp files
        sweep_temp(store.root / "sha256", recursive=True)
    return GcResult(p, tuple(artifacts), tuple(deleted), freed, tuple(errors))


def ensure_blobs(catalog: Catalog, store: BlobStore, manifest: Manifest,
                 reupload: Callable[[], Iterable[BlobRecord]]) -> int:
    """After a push (or copy) committed `manifest`: make sure no gc deleted a blob it
    relied on (rule 3 of the module doc). Returns how many blobs had to be stored again."""
    sizes = {b.digest: b.size for b in manifest.blobs()}
    suspects = catalog.deleted_blobs(sizes)
    repaired = 0
    for _ in range(3):
        if not suspects:
            return repaired
        with ThreadPoolExecutor(8, thread_name_prefix="kvgraft-gc-check") as pool:
            found = list(pool.map(lambda d: _describe(store, d, sizes[d]), sorted(suspects)))
        present = [r for r in found if r is not None]
        missing = suspects - {r.digest for r in present}
        catalog.refresh_blobs(present)  # a row may describe the deleted object's encoding
        if not missing:
            return repaired
        stored = [r for r in reupload() if r.digest in missing]
        catalog.refresh_blobs(stored)
        repaired += len(missing)
        suspects = missing  # check again what was uploaded
    raise Conflict(f"blobs of {manifest.digest} kept disappearing from {store.url} while "
                   f"it was pushed (a gc with a short grace period?)", hint="push again")


def _describe(store: BlobStore, digest: Digest, size: int) -> BlobRecord | None:
    with contextlib.suppress(NotFound):
        return existing_record(store, digest, size)
    return None

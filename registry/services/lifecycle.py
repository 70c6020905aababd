"""Names and deletion: tags move and go, pins and quotas bound what stays
(kvgraft.catalog.lifecycle), and gc deletes what nothing references or uses any more
(planned first, so the plan can be printed)."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

from kvgraft.digest import Digest
from kvgraft.errors import UsageError
from kvgraft.reference import Reference, check_name

if TYPE_CHECKING:
    from kvgraft.catalog.usage import Quota
    from kvgraft.services.backends import Backends
    from kvgraft.services.events import EventLog
    from kvgraft.transfer.gc import GcPlan, GcResult

GC_ELSEWHERE = ("run `kvgraft gc` with a direct remote (--catalog, --store) or through a "
                "kvgraft server: it needs the whole catalog and store")


def _parsed(ref: Reference | str) -> Reference:
    return Reference.parse(ref) if isinstance(ref, str) else ref


class Lifecycle:
    def __init__(self, backends: Backends, events: EventLog) -> None:
        self.backends = backends
        self.events = events

    def tag(self, src: Reference | str, dst: Reference | str) -> Digest:
        src, dst = _parsed(src), _parsed(dst)
        if dst.tag is None:
            raise UsageError(f"the new reference must name a tag: {dst}")
        digest = self.backends.resolve(src)
        self.backends.catalog.set_tag(dst.name, dst.tag, digest, self.events.event(
            "tag", repository=dst.name, tag=dst.tag, digest=digest,
            detail={"source": str(src)}))
        return digest

    def untag(self, ref: Reference | str) -> Digest:
        ref = _parsed(ref)
        if ref.tag is None:
            raise UsageError(f"untag takes name:tag, not a digest: {ref}")
        return self.backends.catalog.remove_tag(
            ref.name, ref.tag, self.events.event("untag", repository=ref.name, tag=ref.tag))

    def pin(self, ref: Reference | str, pinned: bool = True) -> Digest:
        ref = _parsed(ref)
        digest = self.backends.resolve(ref)
        self.backends.catalog.pin(ref.name, digest, pinned, self.events.event(
            "pin" if pinned else "unpin", repository=ref.name, tag=ref.tag, digest=digest))
        return digest

    def set_quota(self, repository: str, max_bytes: int | None) -> int | None:
        """Set (None: remove) a repository's byte quota; returns the previous one."""
        check_name(repository)
        if max_bytes is not None and max_bytes < 0:
            raise UsageError(f"a quota is a number of bytes, not {max_bytes}")
        return self.backends.catalog.set_quota(repository, max_bytes, self.events.event(
            "quota", repository=repository))

    def quotas(self, pattern: str | None = None) -> tuple[Quota, ...]:
        return tuple(q for q in self.backends.catalog.quotas()
                     if pattern is None or fnmatch.fnmatchcase(q.repository, pattern))

    def gc_plan(self, *, grace: float | None = None,
                untagged_older_than: float | None = None,
                unused_for: float | None = None) -> GcPlan:
        from kvgraft.services.backends import Served
        from kvgraft.transfer.gc import DEFAULT_GRACE, plan

        grace = DEFAULT_GRACE if grace is None else grace
        if isinstance(self.backends, Served):  # the server collects its own
            return self.backends.catalog.gc_plan(
                grace=grace, untagged_older_than=untagged_older_than, unused_for=unused_for)
        catalog = self.backends.whole_catalog("gc", GC_ELSEWHERE)
        store = self.backends.whole_store("gc", GC_ELSEWHERE)
        return plan(catalog, store, grace=grace, untagged_older_than=untagged_older_than,
                    unused_for=unused_for)

    def gc(self, gc_plan: GcPlan, *, allow_empty_catalog: bool = False) -> GcResult:
        from kvgraft.services.backends import Served
        from kvgraft.transfer.gc import execute

        if isinstance(self.backends, Served):
            return self.backends.catalog.gc(gc_plan, allow_empty_catalog=allow_empty_catalog)
        catalog = self.backends.whole_catalog("gc", GC_ELSEWHERE)
        store = self.backends.whole_store("gc", GC_ELSEWHERE)
        return execute(catalog, store, gc_plan,
                       self.events.event("gc", detail={"store": store.url}),
                       allow_empty_catalog=allow_empty_catalog)

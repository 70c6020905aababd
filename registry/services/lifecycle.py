"""Names and deletion: tags move and go, and gc deletes what nothing references any more
(planned first, so the plan can be printed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvgraft.digest import Digest
from kvgraft.errors import UsageError
from kvgraft.reference import Reference

if TYPE_CHECKING:
    from kvgraft.services.backends import Backends
    from kvgraft.services.events import EventLog
    from kvgraft.transfer.gc import GcPlan, GcResult

GC_ELSEWHERE = ("run `kvgraft gc` on the server's host with a direct remote (--catalog, "
                "--store): it needs the whole catalog and store")


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

    def gc_plan(self, *, grace: float | None = None,
                untagged_older_than: float | None = None) -> GcPlan:
        from kvgraft.transfer.gc import DEFAULT_GRACE, plan

        catalog = self.backends.whole_catalog("gc", GC_ELSEWHERE)
        store = self.backends.whole_store("gc", GC_ELSEWHERE)
        return plan(catalog, store, grace=DEFAULT_GRACE if grace is None else grace,
                    untagged_older_than=untagged_older_than)

    def gc(self, gc_plan: GcPlan, *, allow_empty_catalog: bool = False) -> GcResult:
        from kvgraft.transfer.gc import execute

        catalog = self.backends.whole_catalog("gc", GC_ELSEWHERE)
        store = self.backends.whole_store("gc", GC_ELSEWHERE)
        return execute(catalog, store, gc_plan,
                       self.events.event("gc", detail={"store": store.url}),
                       allow_empty_catalog=allow_empty_catalog)

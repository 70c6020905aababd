"""The connector's scheduler side: what the registry can restore for each new request, and
which computed prompts the worker side publishes.

For a new request, the longest prefix of its prompt the registry holds for this engine's
identity (one indexed prefix lookup), aligned down to whole vLLM blocks and kept one token
short of the prompt (vLLM must compute at least the last token). The chunks it needs are
fetched into the machine cache, each verified, before vLLM is told: a corrupt blob or an
unreachable store or catalog means 0 tokens matched, and the request computes its prefill.
The lookup and that fetch run on a lookup thread, never on vLLM's scheduler thread: until
they answer, the connector tells vLLM "not known yet" (None) and the scheduler keeps serving
the other requests and asks again on its next step; a lookup that has not answered within
`lookup_timeout` seconds is given up and the request computes.

Before the fetch, the lookup thread decides whether the restore pays
(kvgraft.integrations.restorecost): with `restore_when = "faster"`, a restore estimated
slower than computing the tokens it saves is skipped (counted as `skipped.slower`) and the
request computes its prefill. The figures are measured here: the store's from the chunks
fetched, the engine's prefill rate from the steps vLLM runs (from the end of a step's
scheduling, or the previous step's output if later, to its output; a step without prompt
tokens measures the per-step overhead; a step that loads a restore measures nothing), and
each restore's overhead from its decision to the end of the step that loads it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvgraft.formats.manifest import Manifest
from kvgraft.identity.model import ModelIdentity
from kvgraft.integrations.restorecost import Estimate
from kvgraft.integrations.vllm.common import (
    Context,
    KvgraftMetadata,
    LoadSpec,
    LookupTimedOut,
    SaveSpec,
)
from kvgraft.integrations.vllm.keying import RequestKey, skip_reason
from kvgraft.integrations.vllm.store import (
    RestorePlan,
    check_policy,
    lookup,
    missing,
    plan_restore,
    prefetch,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvgraft")
LOOKUP_THREADS = 2  # concurrent lookups; more requests queue behind them
RECENT_GRAFTS = 16  # grafts remembered for prompts that repeat a prefix (no catalog query)
STEPS_IN_FLIGHT = 8  # steps scheduled and not yet answered, timed for the prefill rate

Found = tuple[Manifest, int, str | None]  # (graft, prompt tokens it covers, what it crosses)


# (restore plan, prompt tokens the registry covers, the request's key: None when unknown,
# and the prompt is then not published)
Answer = tuple[RestorePlan | None, int, RequestKey | None]


@dataclass
class _Lookup:
    future: Future[Answer]
    started: float  # time.monotonic() at submission
    polls: int = 0


@dataclass(frozen=True)
class _Recent:
    """A graft a lookup answered, and the prompt tokens it was found to cover."""

    manifest: Manifest
    tokens: tuple[int, ...]
    cross: str | None
    identity: ModelIdentity  # the (keyed) identity it was looked up for


@dataclass
class _Pending:
    token_ids: list[int]  # the prefix to publish (whole blocks)
    block_ids: list[int]
    key: RequestKey


class RecentGrafts:
    """The last grafts lookups found (shared by the lookup threads): a prompt that repeats a
    prefix one of them covers in full is answered without a catalog query."""

    def __init__(self, capacity: int = RECENT_GRAFTS) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, _Recent] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def recall(self, identity: ModelIdentity, ids: list[int], wanted: int) -> Found | None:
        """A graft for `identity` covering at least `wanted` tokens of `ids`: no other
        graft can give more, so the catalog is not asked again."""
        with self._lock:
            for key, recent in reversed(self._entries.items()):
                n = len(recent.tokens)
                if (n >= wanted and len(ids) >= n and recent.identity == identity
                        and tuple(ids[:n]) == recent.tokens):
                    self._entries.move_to_end(key)
                    return recent.manifest, n, recent.cross
        return None

    def remember(self, identity: ModelIdentity, found: Found, ids: list[int]) -> None:
        manifest, covered, cross = found
        with self._lock:
            key = f"{manifest.digest}:{covered}"
            self._entries[key] = _Recent(manifest, tuple(ids[:covered]), cross, identity)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def forget(self, found: Found) -> None:
        with self._lock:
            self._entries.pop(f"{found[0].digest}:{found[1]}", None)


def prompt_tokens(scheduler_output: SchedulerOutput) -> int:
    """The prompt tokens a step computes: all of a new request's, and a running request's
    when more than one (a prompt's next chunk; one is a decode)."""
    counts = scheduler_output.num_scheduled_tokens
    new = sum(counts.get(r.req_id, 0) for r in scheduler_output.scheduled_new_reqs)
    running = sum(n for r in scheduler_output.scheduled_cached_reqs.req_ids
                  if (n := counts.get(r, 0)) > 1)
    return new + running


class KvgraftConnectorScheduler:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.recent = RecentGrafts()
        self._plans: dict[str, RestorePlan | None] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._lookup_pool = ThreadPoolExecutor(LOOKUP_THREADS,
                                               thread_name_prefix="kvgraft-lookup")
        self._covered: dict[str, int] = {}
        self._keys: dict[str, RequestKey | None] = {}
        self._need_load: dict[str, tuple[RestorePlan, int]] = {}
        self._pending: dict[str, _Pending] = {}
        # (time.monotonic() at the end of scheduling, prompt tokens, requests it loads) of
        # each step in flight
        self._steps: deque[tuple[float, int | None, tuple[str, ...]]] = deque(
            maxlen=STEPS_IN_FLIGHT)
        # request -> (time.monotonic() of its restore's decision, the estimate it was
        # decided on, the prompt tokens computed after it): timed when its load step ends
        self._decided: dict[str, tuple[float, Estimate, int]] = {}
        self._step_done = float("-inf")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   ) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid not in self._plans:
            answer = self._poll_lookup(request, num_computed_tokens)
            if answer is None:
                return None, False  # not known yet: vLLM asks again on a later step
            self._plans[rid], self._covered[rid], self._keys[rid] = answer
        plan = self._plans[rid]
        if plan is None or plan.end <= num_computed_tokens:
            return 0, False
        return plan.end - num_computed_tokens, False

    def _poll_lookup(self, request: Request, local: int) -> Answer | None:
        """The lookup's answer for a new request, None while it runs. The first call starts
        it on a lookup thread; later calls (one per scheduler step) only look at it."""
        rid = request.request_id
        pending = self._lookups.get(rid)
        if pending is None:
            ids = self._lookup_ids(request, local)
            if ids is None:  # not ours: never published
                return None, len(request.prompt_token_ids or []), None
            future = self._lookup_pool.submit(self._find, rid, ids, local,
                                              request.lora_request, request.cache_salt)
            self._lookups[rid] = pending = _Lookup(future, time.monotonic())
            return None
        pending.polls += 1
        waited = time.monotonic() - pending.started
        if pending.future.done():
            del self._lookups[rid]
            log.debug("kvgraft: request %s lookup answered after %.3f s (%d polls)",
                      rid, waited, pending.polls)
            return pending.future.result()  # _find raises nothing
        timeout = self.ctx.settings.lookup_timeout
        if waited < timeout:
            return None
        del self._lookups[rid]
        pending.future.cancel()  # a lookup still queued never starts; a running one ends
        self.ctx.fallback(rid, None, LookupTimedOut(  # on its own, answering nobody
            f"no answer from the registry in {timeout:g} s"))
        # published only if its key is known without hashing an adapter
        key = (None if request.lora_request is not None
               else self.ctx.keys.key(None, request.cache_salt))
        return None, 0, key

    def _lookup_ids(self, request: Request, local: int) -> list[int] | None:
        """The prompt to look up (a copy: the lookup thread must not share vLLM's list),
        None when the connector has nothing to restore or publish for it."""
        ctx = self.ctx
        if not ctx.enabled or not (ctx.restore or ctx.publish):
            return None
        skip = skip_reason(request)
        if skip is not None:
            ctx.counters.add(f"skipped.{skip}")
            log.info("kvgraft: request %s is neither restored nor published (%s)",
                     request.request_id, skip.replace("_", " "))
            return None
        ids = [int(t) for t in (request.prompt_token_ids or [])]
        if len(ids) < max(1, ctx.settings.min_tokens):
            return None
        if local >= self._wanted(len(ids)):
            # vLLM's own prefix cache holds all a graft could give and this engine computed
            # (so published) it: no lookup, the request is not kept waiting for one
            return None
        if len(ids) < ctx.block:
            return None  # nothing to restore (a block and a token) nor to publish (a block)
        return ids

    def _wanted(self, n: int) -> int:
        """Prompt tokens a lookup can be useful for: the most a restore can give (whole
        blocks, one token left to compute) and the whole blocks a publish would store."""
        return n // self.ctx.block * self.ctx.block

    def _find(self, rid: str, ids: list[int], local: int, lora: Any,
              salt: str | None) -> Answer:
        """On a lookup thread: (restore plan or None, prompt tokens the registry covers,
        the request's key). `local`: tokens vLLM's own prefix cache had when the request
        was first seen; `lora`, `salt`: the request's adapter and cache_salt."""
        ctx = self.ctx
        key: RequestKey | None = None
        digest = None
        recalled = None
        try:
            key = ctx.keys.key(lora, salt)  # an adapter is hashed once, here
            ident = ctx.keyed(key)
            if ctx.registry is None or ident is None:
                return None, 0, None
            t0 = time.perf_counter()
            found = recalled = self.recent.recall(ident.identity, ids, self._wanted(len(ids)))
            if found is None:
                found = lookup(ctx.registry, ident, ids, ctx.settings.allow_cross_engine,
                               ctx.scope, ctx.settings.allow_cross_layout)
            covered = 0 if found is None else found[1]
            end = min(covered, len(ids) - 1) // ctx.block * ctx.block
            if found is None or not ctx.restore or end <= local:
                return None, covered, key
            digest = str(found[0].digest)
            plan = self._prepare(rid, ids, found, end, local, t0, recalled is not None)
            if recalled is None:  # only a graft the policy (and fetch) accepted
                self.recent.remember(ident.identity, found, ids)
            return plan, covered, key
        except Exception as e:
            if recalled is not None:  # ask the catalog next time: it may know a better one
                self.recent.forget(recalled)
            ctx.fallback(rid, digest, e)
            return None, 0, key

    def _prepare(self, rid: str, ids: list[int], found: Found, end: int, local: int,
                 t0: float, recalled: bool) -> RestorePlan | None:
        """The restore of `found`'s first `end` tokens, once the registry's policy accepts
        the graft and its chunks are in the machine cache, each verified; None when
        computing the `end - local` tokens it saves is estimated faster."""
        ctx = self.ctx
        registry = ctx.registry
        assert registry is not None
        manifest, covered, cross = found
        decided = time.monotonic()
        t1 = time.perf_counter()
        check_policy(registry, ctx.repository, manifest.digest, manifest)
        t2 = time.perf_counter()
        plan = plan_restore(manifest, end, covered, cross)
        lacking, cached = missing(registry, plan)
        estimate = ctx.cost.estimate(end - local, lacking, cached)
        if not estimate.restores:
            ctx.counters.add("skipped.slower")
            log.info("kvgraft: request %s computes its prefill, restoring %d tokens from %s "
                     "would be slower: %s", rid, end - local, manifest.digest,
                     estimate.describe())
            if ctx.cost.probe_due():  # measure the store again, off the request
                ctx.bg.submit("probe", lambda: self._probe(plan))
            return None
        fetched = prefetch(registry, plan, ctx.cost.store.observe)
        t3 = time.perf_counter()
        log.info("kvgraft: request %s restores %d of %d prompt tokens from %s%s "
                 "(lookup %.4f s, policy %.4f s, fetch %.4f s, %d bytes fetched%s; "
                 "estimated %s)",
                 rid, end, len(ids), manifest.digest, f" (cross-{cross})" if cross else "",
                 t1 - t0, t2 - t1, t3 - t2, fetched,
                 ", a recent graft: no catalog query" if recalled else "",
                 estimate.describe())
        if estimate.restore_s is None:  # the fetch just measured the store: estimate again
            estimate = ctx.cost.estimate(end - local, lacking, cached)
        self._decided[rid] = (decided, estimate, len(ids) - end)
        return plan

    def _probe(self, plan: RestorePlan) -> None:
        registry = self.ctx.registry
        if registry is not None:
            fetched = prefetch(registry, plan, self.ctx.cost.store.observe)
            log.info("kvgraft: probed the store: %d bytes fetched, now %.0f bytes/s, "
                     "%.4f s a request", fetched, self.ctx.cost.store.bytes_per_s or 0.0,
                     self.ctx.cost.store.latency or 0.0)

    def step_done(self) -> None:
        """vLLM answered the oldest step in flight: its prompt tokens and time measure the
        engine's prefill rate (a step without any, its per-step overhead)."""
        now = time.monotonic()
        if self._steps:
            scheduled, tokens, loads = self._steps.popleft()
            if tokens is not None:  # None: a step that computed nothing
                self.ctx.cost.prefill.observe(tokens, now - max(scheduled, self._step_done))
            for rid in loads:  # each restore's whole cost, waits and copies included
                decided = self._decided.pop(rid, None)
                if decided is not None:
                    self.ctx.cost.observe_restore(now - decided[0], decided[1], decided[2])
        self._step_done = now

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if num_external_tokens > 0 and plan is not None:
            self._need_load[request.request_id] = (plan, plan.end - num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvgraftMetadata:
        meta = KvgraftMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            blocks = list(new.block_ids[0]) if new.block_ids else []
            if rid in self._need_load:
                plan, start = self._need_load.pop(rid)
                meta.loads.append(LoadSpec(rid, plan, start, blocks[: plan.end // self.ctx.block]))
            self._hold_for_publish(rid, list(new.prompt_token_ids or []), blocks)
            self._maybe_save(meta, rid, new.num_computed_tokens
                             + scheduler_output.num_scheduled_tokens.get(rid, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self._cached_step(meta, scheduler_output, i, rid)
        # a step that loads a restore spends its copy besides its prompt tokens: not a
        # measure of the prefill rate (it would make computing look slower than it is)
        self._steps.append((time.monotonic(), prompt_tokens(scheduler_output)
                            if scheduler_output.total_num_scheduled_tokens and not meta.loads
                            else None, tuple(spec.req_id for spec in meta.loads)))
        return meta

    def _hold_for_publish(self, rid: str, ids: list[int], blocks: list[int]) -> None:
        """Keep a new request's whole blocks the registry lacks, to publish once computed
        (the last chunk of the graft is partial unless the chunk size divides them)."""
        ctx = self.ctx
        n = len(ids) // ctx.block * ctx.block
        key = self._keys.get(rid)
        if (ctx.publish and ctx.enabled and n > 0 and n > self._covered.get(rid, n)
                and key is not None and len(ids) >= ctx.settings.min_tokens):
            self._pending[rid] = _Pending(ids[:n], blocks, key)

    def _cached_step(self, meta: KvgraftMetadata, scheduler_output: SchedulerOutput,
                     i: int, rid: str) -> None:
        """A request scheduled before: a load again if it resumed after preemption, and
        its new blocks for a publish still pending."""
        cached = scheduler_output.scheduled_cached_reqs
        new_blocks = cached.new_block_ids[i]
        if rid in self._need_load and rid in cached.resumed_req_ids and new_blocks:
            # resumed after preemption: its blocks were freed and must be loaded again;
            # for a resumed request new_block_ids are all of its blocks
            plan, start = self._need_load.pop(rid)
            meta.loads.append(LoadSpec(rid, plan, start,
                                       list(new_blocks[0])[: plan.end // self.ctx.block]))
        pending = self._pending.get(rid)
        if pending is None:
            return
        if new_blocks is not None:
            if rid in cached.resumed_req_ids:
                pending.block_ids = list(new_blocks[0])
            else:
                pending.block_ids.extend(new_blocks[0])
        self._maybe_save(meta, rid, cached.num_computed_tokens[i]
                         + scheduler_output.num_scheduled_tokens.get(rid, 0))

    def _maybe_save(self, meta: KvgraftMetadata, rid: str, computed_after_step: int) -> None:
        pending = self._pending.get(rid)
        if pending is None or computed_after_step < len(pending.token_ids):
            return
        del self._pending[rid]
        nblocks = len(pending.token_ids) // self.ctx.block
        meta.saves.append(SaveSpec(rid, pending.token_ids, pending.block_ids[:nblocks],
                                   pending.key))

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        for d in (self._plans, self._covered, self._keys, self._need_load, self._pending):
            d.pop(rid, None)
        # a request that ends in the step that loads it (one token asked) is timed when
        # that step's output is counted, which vLLM does after finishing the request
        if not any(rid in loads for _, _, loads in self._steps):
            self._decided.pop(rid, None)
        pending = self._lookups.pop(rid, None)
        if pending is not None:
            pending.future.cancel()
        return False, None

    def shutdown(self) -> None:
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self.ctx.close()

"""KvgraftConnector: vLLM's KV connector (v1 API) backed by the kvgraft registry.

Scheduler side: for a new request, the longest prefix of its prompt the registry holds for
this engine's identity (one indexed prefix lookup), aligned down to whole vLLM blocks and
kept one token short of the prompt (vLLM must compute at least the last token). The chunks
it needs are fetched into the machine cache, each verified, before vLLM is told: a corrupt
blob or an unreachable store or catalog means 0 tokens matched, and the request computes
its prefill. The lookup and that fetch run on a lookup thread, never on vLLM's scheduler
thread: until they answer, the connector tells vLLM "not known yet" (None) and the
scheduler keeps serving the other requests and asks again on its next step; a lookup that
has not answered within `lookup_timeout` seconds is given up and the request computes.
Worker side: the chunks are read back from the machine cache (verified again on read) and
written into the blocks vLLM allocated. Prompts the engine computed are published, full
chunks only, by a background thread.

Failures never reach vLLM: each one is logged, counted and recorded as an audit event,
and the request computes what it would have restored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, RegistryError
from kvgraft.formats.manifest import BlobRef, Manifest
from kvgraft.integrations.vllm import paged
from kvgraft.integrations.vllm.background import Background, Counters
from kvgraft.integrations.vllm.hot import HotChunks, MiB
from kvgraft.integrations.vllm.identity import EngineIdentity, engine_identity
from kvgraft.integrations.vllm.store import (
    RestorePlan,
    Settings,
    aligned_chunk_tokens,
    check_policy,
    default_repository,
    event,
    lookup,
    plan_restore,
    prefetch,
    publish,
)
from kvgraft.transfer.pull import Fetcher

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvgraft")
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
CLOSE_TIMEOUT = 120.0  # seconds shutdown waits for queued publishes
LOAD_THREADS = 2  # threads of a restore, each reading, verifying and copying whole chunks
LOOKUP_THREADS = 2  # concurrent lookups; more requests queue behind them
RECENT_GRAFTS = 16  # grafts remembered for prompts that repeat a prefix (no catalog query)


def _unpin() -> None:
    """Let a restore thread run on every core this process may use. vLLM's CPU worker pins
    its thread to one core of its OpenMP set and new threads inherit that, so both restore
    threads would share one core while the OpenMP threads on the others wait for the
    forward. (On 2 cores vLLM keeps the second for its engine process, whose busy-wait
    holds it while the worker runs: measured no faster there.)"""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


class LookupTimedOut(TimeoutError):
    """The registry did not answer a request's lookup within `lookup_timeout`."""


@dataclass
class LoadSpec:
    req_id: str
    plan: RestorePlan
    start: int  # tokens vLLM already had (its own prefix cache): not rewritten
    block_ids: list[int]


@dataclass
class SaveSpec:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class KvgraftMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Lookup:
    future: Future[tuple[RestorePlan | None, int]]  # (plan, tokens the registry covers)
    started: float  # time.monotonic() at submission
    polls: int = 0


@dataclass(frozen=True)
class _Recent:
    """A graft a lookup answered, and the prompt tokens it was found to cover."""

    manifest: Manifest
    tokens: tuple[int, ...]
    cross_engine: bool


@dataclass
class _Pending:
    token_ids: list[int]  # the prefix to publish (whole chunks)
    block_ids: list[int]


def _reason(e: BaseException) -> str:
    if isinstance(e, IntegrityError):
        return "integrity"
    if isinstance(e, LookupTimedOut):
        return "timeout"
    if isinstance(e, ConnectionError | TimeoutError | OSError):
        return "unavailable"
    return type(e).__name__


class KvgraftConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        ktc = self._kv_transfer_config
        self.settings = Settings.parse(dict(ktc.kv_connector_extra_config or {}))
        self.counters = Counters()
        self._block = int(vllm_config.cache_config.block_size)
        self._chunk = aligned_chunk_tokens(self.settings.chunk_tokens, self._block)
        self._restore = (ktc.is_kv_consumer if self.settings.restore is None
                         else bool(self.settings.restore))
        self._publish = (ktc.is_kv_producer if self.settings.publish is None
                         else bool(self.settings.publish))
        self.ident: EngineIdentity | None = None
        self.registry: Registry | None = None
        self.repository = self.settings.repository or ""
        try:
            self.registry = self.settings.open()
            from vllm.platforms import current_platform

            if current_platform.device_type != "cpu":
                raise RegistryError("the kvgraft connector supports vLLM's CPU attention "
                                    "backend's paged layout only")
            self.ident = engine_identity(vllm_config, backend="CPU_ATTN",
                                         cache_dir=self.registry.config.cache_dir)
            self.repository = self.repository or default_repository(self.ident.name)
        except Exception as e:  # never stop the engine: serve without the registry
            self.counters.add("disabled")
            log.error("kvgraft: connector disabled, every request computes its prefill: %s", e)
        self._bg = Background(f"kvgraft-{role.name.lower()}",
                              max(1, self.settings.queue_size), self.counters)
        # scheduler state
        self._plans: dict[str, RestorePlan | None] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._recent: OrderedDict[str, _Recent] = OrderedDict()  # lookup threads, _lock
        self._lookup_pool = ThreadPoolExecutor(LOOKUP_THREADS,
                                               thread_name_prefix="kvgraft-lookup")
        self._covered: dict[str, int] = {}
        self._need_load: dict[str, tuple[RestorePlan, int]] = {}
        self._pending: dict[str, _Pending] = {}
        # worker state
        self._views: list[paged.PagedLayer] = []
        self._saving: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._load_errors: set[int] = set()
        self._bufs: list[bytearray] = []
        self._hot = HotChunks(self.settings.memory_cache_mb * MiB)
        self._lock = threading.Lock()
        if self.ident is not None:
            log.info("kvgraft: %s side ready for %s (identity %s, chunks of %d tokens, "
                     "restore=%s publish=%s)", role.name.lower(), self.ident.name,
                     self.ident.identity.key, self._chunk, self._restore, self._publish)

    @property
    def enabled(self) -> bool:
        return self.ident is not None and self.registry is not None

    def _record(self, action: str, digest: str | None, outcome: str,
                detail: dict[str, Any]) -> None:
        registry = self.registry
        if registry is None:
            return
        full = {"engine": (self.ident.engine if self.ident else None), **detail}
        self._bg.submit("event", lambda: event(registry, action, digest, outcome, full,
                                               self.repository or None))

    def _fallback(self, req_id: str, digest: str | None, e: BaseException) -> None:
        reason = _reason(e)
        self.counters.add(f"fallback.{reason}")
        log.warning("kvgraft: request %s computes its prefill (%s): %s", req_id, reason, e)
        self._record("restore", digest, "failed", {"request": req_id, "reason": reason,
                                                   "error": str(e)})

    # --- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   ) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid not in self._plans:
            answer = self._poll_lookup(request, num_computed_tokens)
            if answer is None:
                return None, False  # not known yet: vLLM asks again on a later step
            self._plans[rid], self._covered[rid] = answer
        plan = self._plans[rid]
        if plan is None or plan.end <= num_computed_tokens:
            return 0, False
        return plan.end - num_computed_tokens, False

    def _poll_lookup(self, request: Request, local: int,
                     ) -> tuple[RestorePlan | None, int] | None:
        """The lookup's answer for a new request, None while it runs. The first call starts
        it on a lookup thread; later calls (one per scheduler step) only look at it."""
        rid = request.request_id
        pending = self._lookups.get(rid)
        if pending is None:
            ids = self._lookup_ids(request, local)
            if ids is None:
                return None, len(request.prompt_token_ids or [])  # not ours: never published
            future = self._lookup_pool.submit(self._find, rid, ids, local)
            self._lookups[rid] = pending = _Lookup(future, time.monotonic())
            return None
        pending.polls += 1
        waited = time.monotonic() - pending.started
        if pending.future.done():
            del self._lookups[rid]
            log.debug("kvgraft: request %s lookup answered after %.3f s (%d polls)",
                      rid, waited, pending.polls)
            return pending.future.result()  # _find raises nothing
        if waited < self.settings.lookup_timeout:
            return None
        del self._lookups[rid]
        pending.future.cancel()  # a lookup still queued never starts; a running one ends
        self._fallback(rid, None, LookupTimedOut(  # on its own, answering nobody
            f"no answer from the registry in {self.settings.lookup_timeout:g} s"))
        return None, 0

    def _lookup_ids(self, request: Request, local: int) -> list[int] | None:
        """The prompt to look up (a copy: the lookup thread must not share vLLM's list),
        None when the connector has nothing to restore or publish for it."""
        if not self.enabled or not (self._restore or self._publish):
            return None
        ids = [int(t) for t in (request.prompt_token_ids or [])]
        if len(ids) < max(1, self.settings.min_tokens):
            return None
        if local >= self._wanted(len(ids)):
            # vLLM's own prefix cache holds all a graft could give and this engine computed
            # (so published) it: no lookup, the request is not kept waiting for one
            return None
        if len(ids) <= self._block and len(ids) < self._chunk:
            return None  # nothing to restore (a block and a token) nor to publish (a chunk)
        return ids

    def _wanted(self, n: int) -> int:
        """Prompt tokens a lookup can be useful for: the most a restore can give (whole
        blocks, one token left to compute) and the full chunks a publish would store."""
        return max((n - 1) // self._block * self._block, n // self._chunk * self._chunk)

    def _recall(self, ids: list[int]) -> tuple[Manifest, int, bool] | None:
        """A graft a recent lookup found that covers all of this prompt a lookup could
        want: no other graft can give more, so the catalog is not asked again."""
        wanted = self._wanted(len(ids))
        with self._lock:
            for key, recent in reversed(self._recent.items()):
                n = len(recent.tokens)
                if n >= wanted and len(ids) >= n and tuple(ids[:n]) == recent.tokens:
                    self._recent.move_to_end(key)
                    return recent.manifest, n, recent.cross_engine
        return None

    def _remember(self, found: tuple[Manifest, int, bool], ids: list[int]) -> None:
        manifest, covered, cross = found
        with self._lock:
            key = f"{manifest.digest}:{covered}"
            self._recent[key] = _Recent(manifest, tuple(ids[:covered]), cross)
            self._recent.move_to_end(key)
            while len(self._recent) > RECENT_GRAFTS:
                self._recent.popitem(last=False)

    def _find(self, rid: str, ids: list[int], local: int) -> tuple[RestorePlan | None, int]:
        """On a lookup thread: (restore plan or None, prompt tokens the registry covers).
        `local`: tokens vLLM's own prefix cache had when the request was first seen."""
        registry, ident = self.registry, self.ident
        if registry is None or ident is None:
            return None, 0
        digest = None
        recalled = None
        try:
            t0 = time.perf_counter()
            found = recalled = self._recall(ids)
            if found is None:
                found = lookup(registry, ident, ids, self.settings.allow_cross_engine)
            t1 = time.perf_counter()
            covered = 0 if found is None else found[1]
            end = min(covered, len(ids) - 1) // self._block * self._block
            if found is None or not self._restore or end <= local:
                return None, covered
            manifest, _, cross = found
            digest = str(manifest.digest)
            check_policy(registry, self.repository, manifest.digest, manifest)
            t2 = time.perf_counter()
            plan = plan_restore(manifest, end, covered, cross)
            fetched = prefetch(registry, plan)
            t3 = time.perf_counter()
            if recalled is None:
                self._remember(found, ids)  # only a graft the policy and the fetch accepted
            log.info("kvgraft: request %s restores %d of %d prompt tokens from %s%s "
                     "(lookup %.4f s, policy %.4f s, fetch %.4f s, %d bytes fetched%s)",
                     rid, end, len(ids), digest, " (cross-engine)" if cross else "", t1 - t0,
                     t2 - t1, t3 - t2, fetched,
                     ", a recent graft: no catalog query" if recalled else "")
            return plan, covered
        except Exception as e:
            if recalled is not None:  # ask the catalog next time: it may know a better one
                with self._lock:
                    self._recent.pop(f"{recalled[0].digest}:{recalled[1]}", None)
            self._fallback(rid, digest, e)
            return None, 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if num_external_tokens > 0 and plan is not None:
            self._need_load[request.request_id] = (plan, plan.end - num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvgraftMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            blocks = list(new.block_ids[0]) if new.block_ids else []
            if rid in self._need_load:
                plan, start = self._need_load.pop(rid)
                meta.loads.append(LoadSpec(rid, plan, start, blocks[: plan.end // self._block]))
            ids = list(new.prompt_token_ids or [])
            n = len(ids) // self._chunk * self._chunk
            if (self._publish and self.enabled and n > 0 and n > self._covered.get(rid, n)
                    and len(ids) >= self.settings.min_tokens):
                self._pending[rid] = _Pending(ids[:n], blocks)
            self._maybe_save(meta, rid, new.num_computed_tokens
                             + scheduler_output.num_scheduled_tokens.get(rid, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if rid in self._need_load and rid in cached.resumed_req_ids and new_blocks:
                # resumed after preemption: its blocks were freed and must be loaded again;
                # for a resumed request new_block_ids are all of its blocks
                plan, start = self._need_load.pop(rid)
                meta.loads.append(LoadSpec(rid, plan, start,
                                           list(new_blocks[0])[: plan.end // self._block]))
            pending = self._pending.get(rid)
            if pending is None:
                continue
            if new_blocks is not None:
                if rid in cached.resumed_req_ids:
                    pending.block_ids = list(new_blocks[0])
                else:
                    pending.block_ids.extend(new_blocks[0])
            self._maybe_save(meta, rid, cached.num_computed_tokens[i]
                             + scheduler_output.num_scheduled_tokens.get(rid, 0))
        return meta

    def _maybe_save(self, meta: KvgraftMetadata, rid: str, computed_after_step: int) -> None:
        pending = self._pending.get(rid)
        if pending is None or computed_after_step < len(pending.token_ids):
            return
        del self._pending[rid]
        nblocks = len(pending.token_ids) // self._block
        meta.saves.append(SaveSpec(rid, pending.token_ids, pending.block_ids[:nblocks]))

    def request_finished(self, request: Request, block_ids: list[int],
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        for d in (self._plans, self._covered, self._need_load, self._pending):
            d.pop(rid, None)
        pending = self._lookups.pop(rid, None)
        if pending is not None:
            pending.future.cancel()
        return False, None

    # --- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ident = self.ident
        if ident is None:
            return
        try:
            names = sorted(kv_caches, key=lambda n: int(_LAYER_INDEX.search(n).group(1)  # type: ignore[union-attr]
                                                        ))
            if len(names) != ident.layers:
                raise RegistryError(f"{len(names)} paged KV layers, model has {ident.layers}")
            dtype = paged.TORCH_DTYPES[ident.kv_dtype]
            self._views = [paged.block_view(kv_caches[n], ident.kv_heads, self._block,
                                            ident.head_dim, dtype) for n in names]
        except Exception as e:
            self.ident = None
            self.counters.add("disabled")
            log.error("kvgraft: connector disabled (paged KV layout): %s", e)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvgraftMetadata):
            return
        for spec in meta.loads:
            try:
                self._load(spec)
            except Exception as e:
                # The blocks hold nothing trustworthy: vLLM recomputes them
                # (kv_load_failure_policy "recompute") or fails the request ("fail").
                self._load_errors.update(spec.block_ids[spec.start // self._block:])
                self._fallback(spec.req_id, spec.plan.digest, e)

    def _load(self, spec: LoadSpec) -> None:
        registry, ident = self.registry, self.ident
        if registry is None or ident is None or not self._views:
            raise RegistryError("connector disabled")
        t0 = time.perf_counter()
        fetcher = Fetcher(registry.store, registry.cache, keep_decoded=True)
        dtype = paged.TORCH_DTYPES[ident.kv_dtype]
        todo = [c for c in spec.plan.chunks
                if max(c[0], spec.start) < min(c[1], spec.plan.end)]
        size = max(c[3] for c in todo)
        if len(self._bufs) < LOAD_THREADS or len(self._bufs[0]) < size:
            self._bufs = [bytearray(size) for _ in range(LOAD_THREADS)]  # reused
        free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for buf in self._bufs[:LOAD_THREADS]:
            free.put(buf)
        hot, hits0 = self._hot, self._hot.hits

        def read(digest: str, n: int, buf: bytearray) -> memoryview:
            """Chunk `digest`, verified: from memory, else from the machine cache (or the
            store) into memory when it has room, else into `buf`."""
            kept = hot.get(digest)
            if kept is not None:
                return memoryview(kept)
            into = bytearray(n) if n <= hot.capacity else buf
            data, _ = fetcher.get(BlobRef(Digest.parse(digest), n), memoryview(into)[:n])
            if into is not buf:
                hot.put(digest, into)
            return memoryview(data)

        def load(k: int) -> tuple[int, float]:
            """Read, verify and copy chunk k into its blocks: (bytes written, seconds
            reading and verifying)."""
            c_start, c_end, digest, n = todo[k]
            buf = free.get()  # as many buffers as threads: never waits
            try:
                tr = time.perf_counter()
                view = read(digest, n, buf)
                tr = time.perf_counter() - tr
                lo, hi = max(c_start, spec.start), min(c_end, spec.plan.end)
                hlen = int.from_bytes(view[:8], "little")
                header = json.loads(bytes(view[8 : 8 + hlen]))
                base = 8 + hlen
                blocks = spec.block_ids[lo // self._block : hi // self._block]
                a, b = lo - c_start, hi - c_start
                written = 0
                for i, dst in enumerate(self._views):
                    kv = []
                    for part in ("key", "value"):
                        entry = header[f"layers.{i}.{part}"]
                        t = paged.tensor_from(view, base + entry["data_offsets"][0],
                                              tuple(entry["shape"]), dtype)
                        kv.append(t[:, a:b])
                    paged.scatter(dst, blocks, kv[0], kv[1])
                    written += 2 * kv[0].numel() * kv[0].element_size()
                return written, tr
            finally:
                free.put(buf)

        # Each chunk is read, verified and copied by one of two threads: SHA-256 and
        # torch's copies release the GIL, and chunks fill disjoint blocks.
        with ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kvgraft-load",
                                initializer=_unpin) as pool:
            done = list(pool.map(load, range(len(todo))))
        written = sum(w for w, _ in done)
        waited = sum(r for _, r in done)
        in_memory = hot.hits - hits0  # approximate if two restores overlap: a log figure
        seconds = time.perf_counter() - t0
        self.counters.add("restored")
        self.counters.add("restored_tokens", spec.plan.end - spec.start)
        log.info("kvgraft: restored %d tokens of %s into %d blocks (%.1f MB in %.4f s; "
                 "%.4f thread-s reading and verifying chunks, the rest copying; "
                 "%d of %d chunks from memory)",
                 spec.plan.end - spec.start, spec.plan.digest, len(spec.block_ids),
                 written / 1e6, seconds, waited, in_memory, len(todo))
        self._record("restore", spec.plan.digest, "ok", {
            "request": spec.req_id, "tokens": spec.plan.end - spec.start,
            "prefix_tokens": spec.plan.end, "bytes": written, "seconds": round(seconds, 6),
            "cross_engine": spec.plan.cross_engine})

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvgraftMetadata) or not meta.saves or self.ident is None:
            return
        m = _LAYER_INDEX.search(layer_name)
        if m is None:
            return
        view = self._views[int(m.group(1))]
        for spec in meta.saves:
            self._saving.setdefault(spec.req_id, []).append(
                paged.gather(view, spec.block_ids))

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvgraftMetadata) or not meta.saves:
            return
        registry, ident = self.registry, self.ident
        for spec in meta.saves:
            layers = self._saving.pop(spec.req_id, [])
            if registry is None or ident is None or len(layers) != ident.layers:
                continue
            self._bg.submit("publish", self._publisher(registry, ident, spec, layers))

    def _publisher(self, registry: Registry, ident: EngineIdentity, spec: SaveSpec,
                   layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        def job() -> None:
            t0 = time.perf_counter()
            digest = publish(registry, ident, self.repository, self._chunk, spec.token_ids,
                             layers)
            self.counters.add("published")
            log.info("kvgraft: published %d tokens of request %s as %s@%s (%.3f s)",
                     len(spec.token_ids), spec.req_id, self.repository, digest,
                     time.perf_counter() - t0)
        return job

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self._bg.close(CLOSE_TIMEOUT)
        log.info("kvgraft: %s side counters %s", self.role.name.lower(),
                 self.counters.snapshot())
        if self.registry is not None:
            self.registry.close()

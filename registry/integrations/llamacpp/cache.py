"""A prompt cache for llama-cpp-python backed by the registry.

    lm = load_model("model.gguf", cache_dir=registry.config.cache_dir)
    cache = RegistryCache(registry, lm, repository="prompts/smollm2")
    lm.llm.set_cache(cache)
    lm.llm.create_completion(document + question, max_tokens=64)
    cache.close()            # publishes what is still queued

`Llama` asks its cache for the prompt's tokens before each completion and hands it the
state after it. Here a lookup is the registry's indexed prefix match for this model's
identity (engine included: whole chunks by key, then the tokens of the partial last one),
then the graft is opened under the policy and read with every byte verified, and rebuilt as
the context state `Llama.load_state` takes. A new state is queued for publishing on one
background thread (bounded: when full it is dropped and counted), never on the request.

A restore happens only when it pays (`restore_when = "faster"`, the default): the lookup
thread estimates the restore (the graft's blobs the machine cache lacks at the store's
measured speed, plus verifying what it holds) against computing the tokens it saves at the
prefill rate llama.cpp measured for the prompts it computed (its `t_p_eval`/`n_p_eval`
counters), with kvgraft.integrations.restorecost; a slower restore is skipped, counted as
`skipped.slower`, and the prompt computed. A prompt whose prefill is so short that the
measured lookup would cost more than a tenth of it is not looked up (`skipped.short`).

Nothing the registry does can fail a completion or hand llama.cpp wrong KV: a lookup that
raises (a corrupt blob, an unreachable store, a refused graft) or runs past
`lookup_timeout` is logged and counted, and the prompt is computed as without a cache.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from llama_cpp.llama import Llama, LlamaState
from llama_cpp.llama_cache import BaseLlamaCache

from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import IncompatibleModel, IntegrityError, QuotaExceeded, UsageError
from kvgraft.formats.chunks import DEFAULT_CHUNK_TOKENS
from kvgraft.formats.manifest import BlobRef
from kvgraft.integrations.background import Background, Counters
from kvgraft.integrations.llamacpp.engine import LlamaModel
from kvgraft.integrations.llamacpp.graft import load_graft, write_graft
from kvgraft.integrations.llamacpp.state import kv_tensors, parse_seq_state
from kvgraft.integrations.prefetch import prefetch, split_cached
from kvgraft.integrations.restorecost import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    Estimate,
    RestoreCost,
    check_rate,
    check_restore_when,
    fetch_rounds,
)
from kvgraft.provenance import PolicyRefused
from kvgraft.reference import Reference
from kvgraft.services.match import match
from kvgraft.transfer.push import PushOptions

log = logging.getLogger("kvgraft.llamacpp.cache")
T = TypeVar("T")


class LookupTimeout(Exception):
    pass


class RestoreSlower(Exception):
    """Restoring the prefix is estimated slower than computing it."""

    def __init__(self, estimate: Estimate) -> None:
        super().__init__(estimate.describe())
        self.estimate = estimate


@dataclass(frozen=True, slots=True)
class CacheSettings:
    repository: str  # where new prompts are published (tag t-<token digest>)
    lookup_timeout: float = 5.0  # seconds a completion waits for its lookup and restore
    min_tokens: int = 16  # shorter prompts are neither looked up nor published
    publish: bool = True
    restore: bool = True
    queue_size: int = 4  # states waiting to be published (each holds the context state)
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # "faster": restore only when estimated faster than computing the prompt
    # (kvgraft.integrations.restorecost); "always": whenever the registry has a prefix
    restore_when: str = "faster"
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S  # until llama.cpp measured

    def __post_init__(self) -> None:
        Reference(self.repository, tag="latest")  # refuses an invalid repository name
        check_restore_when(self.restore_when)
        check_rate("prefill_tokens_per_s", self.prefill_tokens_per_s)
        if not self.lookup_timeout > 0:
            raise UsageError("lookup_timeout must be a positive number of seconds")
        if self.queue_size < 1 or self.min_tokens < 1:
            raise UsageError("queue_size and min_tokens must be at least 1")


def arch_header(lm: LlamaModel) -> bytes:
    """What `llama_state_get_data` writes before the KV cache: the architecture's name."""
    arch = str(lm.fingerprint.config["general.architecture"]).encode()
    return struct.pack("<I", len(arch)) + arch


def fallback_reason(e: BaseException) -> str:
    if isinstance(e, LookupTimeout):
        return "timeout"
    if isinstance(e, PolicyRefused | IncompatibleModel):
        return "refused"
    if isinstance(e, IntegrityError):
        return "corrupt"
    if isinstance(e, OSError):  # ConnectionError and Unavailable are OSErrors
        return "unreachable"
    return "error"


def _within(seconds: float, job: Callable[[], T]) -> T:
    """`job()` on a daemon thread, waited for `seconds`: a store that hangs keeps its thread,
    never the completion (nor the interpreter's exit)."""
    box: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, job()))
        except BaseException as e:  # handed to the caller
            box.append((False, e))
        done.set()

    threading.Thread(target=run, name="kvgraft-lookup", daemon=True).start()
    if not done.wait(seconds):
        raise LookupTimeout(f"lookup took more than {seconds} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


class RegistryCache(BaseLlamaCache):
    """A `BaseLlamaCache` for `Llama.set_cache()`: restores the longest registry prefix of
    the prompt for `lm`'s identity and publishes computed prompts in the background."""

    def __init__(self, registry: Registry, lm: LlamaModel, *, repository: str,
                 settings: CacheSettings | None = None) -> None:
        super().__init__(capacity_bytes=0)  # what the registry keeps is its gc's to decide
        self.registry, self.lm = registry, lm
        self.settings = settings or CacheSettings(repository)
        if settings is not None and settings.repository != repository:
            raise UsageError("repository and settings.repository differ")
        self.counters = Counters()
        self.cost = RestoreCost(self.settings.restore_when, self.settings.prefill_tokens_per_s)
        self._perf = self._prompt_evals()
        self._published_bytes = 0
        self._bg = Background("kvgraft-llamacpp", self.settings.queue_size, self.counters, log)

    @property
    def cache_size(self) -> int:
        return self._published_bytes

    def close(self, timeout: float = 300.0) -> None:
        """Publish what is queued (up to `timeout` seconds), then stop."""
        self._bg.close(timeout)

    # --- restore cost ---------------------------------------------------------------------

    def _prompt_evals(self) -> tuple[int, float]:
        """(prompt tokens, seconds) llama.cpp has evaluated in batches in this context."""
        import llama_cpp

        ctx: Any = getattr(getattr(self.lm.llm, "_ctx", None), "ctx", None)
        if ctx is None:
            return 0, 0.0
        perf = llama_cpp.llama_perf_context(ctx)
        return int(perf.n_p_eval), float(perf.t_p_eval_ms) / 1000.0

    def measure_prefill(self) -> None:
        """Take the prompts llama.cpp computed since last asked into the prefill rate."""
        tokens, seconds = now = self._prompt_evals()
        dt, ds = tokens - self._perf[0], seconds - self._perf[1]
        self._perf = now
        if dt > 0:
            self.cost.prefill.observe(dt, ds)

    # --- lookup ---------------------------------------------------------------------------

    def _state(self, key: tuple[int, ...], in_context: int, rows: int, vocab: int,
               seed: int) -> LlamaState | None:
        """The context state of the longest registry prefix of `key` (None when it is not
        longer than the `in_context` tokens llama.cpp already holds). Runs on the lookup
        thread: it reads the registry, never the engine."""
        t0 = time.perf_counter()
        found = match(self.registry, self.lm.identity, key)
        # What every prompt looked up pays. The found graft's manifest, read next, comes from
        # the store once per machine, then from the machine cache: a restore's cost.
        self.cost.observe_lookup(time.perf_counter() - t0)
        if found is None or found.length <= in_context:
            return None
        name = found.references[0].rsplit(":", 1)[0] if found.references else None
        manifest = self.registry.manifest(found.digest)
        blobs = [manifest.header, manifest.tokens,
                 *(BlobRef(c.digest, c.size) for c in manifest.chunks)]
        lacking, cached = split_cached(self.registry, blobs)
        missing_bytes = sum(b.size for b in lacking)
        estimate = self.cost.estimate(min(found.length, len(key)) - in_context,
                                      [b.size for b in lacking], cached)
        if not estimate.restores:
            if self.cost.probe_due():  # measure the store again, off the completion
                self._bg.submit("probe", lambda: prefetch(self.registry, lacking,
                                                          self.cost.store.observe))
            raise RestoreSlower(estimate)
        t0 = time.perf_counter()
        head = arch_header(self.lm)
        graft = load_graft(self.registry, self.lm,
                           Reference(name or self.settings.repository, digest=found.digest),
                           build=lambda ids: min(found.length, len(ids)), prefix=head)
        if lacking:  # the whole load, verifying included: what the estimate stands for
            self.cost.store.observe(missing_bytes,
                                    fetch_rounds(len(lacking), self.cost.fetch_threads),
                                    time.perf_counter() - t0)
        log.info("kvgraft: restoring %d prompt tokens from %s (%s)",
                 found.length - in_context, found.digest, estimate.describe())
        n = min(found.length, graft.token_count)
        if list(graft.token_ids[:n]) != list(key[:n]):
            raise IntegrityError(f"graft {found.digest} does not hold the matched tokens")
        with graft.state(self.lm, n, prefix=head) as built:
            state = bytes(built)
        # llama.cpp sets the state and computes the rest after this returns: both are in
        # the prefill the engine measures, so the overhead here is the load beyond its bytes
        self.cost.observe_restore(time.perf_counter() - t0, estimate)
        ids = np.zeros(rows, dtype=np.intc)
        ids[:n] = key[:n]
        # the restored positions' logits are not kept: llama-cpp-python evaluates at least
        # the prompt's last token again before sampling (Llama.generate, _requires_eval)
        scores = np.zeros((1, vocab), dtype=np.single)
        return LlamaState(ids, scores, n, state, len(state), seed)

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        ids = tuple(int(t) for t in key)
        if not self.settings.restore or len(ids) < self.settings.min_tokens:
            raise KeyError("not looked up")
        self.measure_prefill()
        llm = self.lm.llm
        in_context = Llama.longest_token_prefix(llm._input_ids.tolist(), ids)
        if not self.cost.lookup_pays(len(ids) - in_context):
            self.counters.add("skipped.short")
            raise KeyError("too few tokens to compute for a lookup to pay")
        self.counters.add("lookups")
        try:
            args = (ids, in_context, len(llm.input_ids), llm.n_vocab(), llm._seed)
            state = _within(self.settings.lookup_timeout, lambda: self._state(*args))
        except RestoreSlower as e:
            self.counters.add("skipped.slower")
            log.info("kvgraft: computing the prompt, restoring would be slower: %s", e)
            raise KeyError("restoring is slower") from e
        except Exception as e:  # never fail the completion: it computes its prompt
            reason = fallback_reason(e)
            self.counters.add(f"fallback.{reason}")
            log.warning("kvgraft: prompt cache lookup failed (%s), computing the prompt: %s",
                        reason, e)
            raise KeyError("lookup failed") from e
        if state is None:
            self.counters.add("misses")
            raise KeyError("no cached prefix")
        self.counters.add("hits")
        self.counters.add("restored_tokens", state.n_tokens)
        return state

    def __contains__(self, key: Sequence[int]) -> bool:
        ids = tuple(int(t) for t in key)
        if len(ids) < self.settings.min_tokens:
            return False
        try:
            found = _within(self.settings.lookup_timeout,
                            lambda: match(self.registry, self.lm.identity, ids))
        except Exception as e:
            log.warning("kvgraft: prompt cache lookup failed: %s", e)
            return False
        return found is not None

    # --- publish --------------------------------------------------------------------------

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        self.measure_prefill()  # llama-cpp-python hands the state after each completion
        if not self.settings.publish or value.n_tokens < self.settings.min_tokens:
            return
        # the state's bytes are immutable and its ids a copy: safe to hand to the thread
        data, ids = value.llama_state, [int(t) for t in value.input_ids[: value.n_tokens]]
        self._bg.submit("publish", lambda: self._publish(ids, data))

    def _publish(self, ids: list[int], data: bytes) -> None:
        found = match(self.registry, self.lm.identity, ids)
        if found is not None and found.length >= len(ids):
            self.counters.add("publish.known")
            return
        head = arch_header(self.lm)
        if not data.startswith(head):
            raise UsageError("the llama.cpp state is not of this model's architecture")
        count, v_trans, layers = parse_seq_state(memoryview(data)[len(head):], self.lm.shape)
        if count != len(ids) or v_trans != self.lm.v_trans:
            raise UsageError(f"the llama.cpp state holds {count} cells for {len(ids)} tokens")
        tmp_dir = self.registry.config.cache_dir / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="llamacpp-", suffix=".kv", dir=tmp_dir)
        os.close(fd)
        try:
            path = write_graft(self.lm.fingerprint, ids, kv_tensors(layers), name,
                               created=datetime.now(UTC))
            tokens = Digest.of(np.asarray(ids, dtype="<i8").tobytes())
            ref = Reference(self.settings.repository, tag=f"t-{tokens.hex[:32]}")
            try:
                self.registry.push(path, ref,
                                   options=PushOptions(chunk_tokens=self.settings.chunk_tokens))
            except QuotaExceeded as e:  # the repository is full of pinned grafts
                self.counters.add("dropped.quota")
                log.warning("kvgraft: prompt not published: %s", e)
                return
            self._published_bytes += len(data)
            self.counters.add("published")
        finally:
            Path(name).unlink(missing_ok=True)

"""What both sides of the connector share: the metadata the scheduler side hands the
worker side each step, and the context each side opens from vLLM's configuration.

vLLM constructs the connector once per role (the scheduler's, and each worker's), in the
process that role runs in. Each builds its own `Context` from the same configuration, the
same way, so the two sides reach the same decision on whether the connector serves this
engine, for which identity and into which repository.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvgraft.client import Registry
from kvgraft.errors import IntegrityError, RegistryError
from kvgraft.integrations.background import Background, Counters
from kvgraft.integrations.restorecost import RestoreCost
from kvgraft.integrations.vllm.identity import EngineIdentity, check_served, engine_identity
from kvgraft.integrations.vllm.keying import Keys, RequestKey, salt_key
from kvgraft.integrations.vllm.store import (
    RestorePlan,
    Settings,
    aligned_chunk_tokens,
    default_repository,
    event,
)

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig

log = logging.getLogger("vllm.kvgraft")
CLOSE_TIMEOUT = 120.0  # seconds shutdown waits for queued publishes


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
    key: RequestKey  # what besides the tokens the KV was computed with


@dataclass
class KvgraftMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def reason(e: BaseException) -> str:
    """The fallback's reason, as counted and recorded."""
    if isinstance(e, IntegrityError):
        return "integrity"
    if isinstance(e, LookupTimedOut):
        return "timeout"
    if isinstance(e, ConnectionError | TimeoutError | OSError):
        return "unavailable"
    return type(e).__name__


class Context:
    """One side's settings, registry, engine identity and background queue (audit events,
    publishes). `ident` is None when the connector is off for this engine: every request
    then computes its prefill and nothing is published."""

    def __init__(self, vllm_config: VllmConfig, ktc: KVTransferConfig, side: str) -> None:
        self.side = side
        self.settings = Settings.parse(dict(ktc.kv_connector_extra_config or {}))
        self.counters = Counters()
        # whether a restore pays (the scheduler side's lookups decide, and measure)
        self.cost = RestoreCost(self.settings.restore_when,
                                self.settings.prefill_tokens_per_s)
        self.block = int(vllm_config.cache_config.block_size)
        self.chunk = aligned_chunk_tokens(self.settings.chunk_tokens, self.block)
        self.restore = (ktc.is_kv_consumer if self.settings.restore is None
                        else bool(self.settings.restore))
        self.publish = (ktc.is_kv_producer if self.settings.publish is None
                        else bool(self.settings.publish))
        self.ident: EngineIdentity | None = None
        self.registry: Registry | None = None
        self.repository = self.settings.repository or ""
        try:
            self._open(vllm_config)
        except Exception as e:  # never stop the engine: serve without the registry
            self.disable("connector disabled, every request computes its prefill", e)
        # the same on both sides: the salt key and the scope follow the repository
        self.keys = Keys(salt_key(self.settings.salt_key, self.repository))
        self.scope = self.settings.scope(self.repository)
        self.bg = Background(f"kvgraft-{side}", max(1, self.settings.queue_size),
                             self.counters, log)
        if self.ident is not None:
            log.info("kvgraft: %s side ready for %s (identity %s, chunks of %d tokens, "
                     "restore=%s publish=%s)", side, self.ident.name,
                     self.ident.identity.key, self.chunk, self.restore, self.publish)

    def _open(self, vllm_config: VllmConfig) -> None:
        self.registry = self.settings.open()
        from vllm.platforms import current_platform

        if current_platform.device_type != "cpu":
            raise RegistryError("the kvgraft connector supports vLLM's CPU attention "
                                "backend's paged layout only")
        check_served(vllm_config)
        self.ident = engine_identity(vllm_config, backend="CPU_ATTN",
                                     cache_dir=self.registry.config.cache_dir)
        self.repository = self.repository or default_repository(self.ident.name)

    @property
    def enabled(self) -> bool:
        return self.ident is not None and self.registry is not None

    def keyed(self, key: RequestKey) -> EngineIdentity | None:
        """The identity of the grafts of requests with `key` (None: the connector is off)."""
        ident = self.ident
        return None if ident is None else self.keys.identity(ident, key)

    def disable(self, what: str, e: BaseException) -> None:
        self.ident = None
        self.counters.add("disabled")
        log.error("kvgraft: %s: %s", what, e)

    def record(self, action: str, digest: str | None, outcome: str,
               detail: dict[str, Any]) -> None:
        """An audit event, written off the request path."""
        registry = self.registry
        if registry is None:
            return
        full = {"engine": (self.ident.engine if self.ident else None), **detail}
        if action == "restore" and outcome == "ok" and "seconds" in detail:
            self.counters.observe("restore_seconds", float(detail["seconds"]))
        self.bg.submit("event", lambda: event(registry, action, digest, outcome, full,
                                              self.repository or None))

    def fallback(self, req_id: str, digest: str | None, e: BaseException) -> None:
        """A restore that did not happen: logged, counted, recorded; the request computes."""
        why = reason(e)
        self.counters.add(f"fallback.{why}")
        log.warning("kvgraft: request %s computes its prefill (%s): %s", req_id, why, e)
        self.record("restore", digest, "failed", {"request": req_id, "reason": why,
                                                  "error": str(e)})

    def close(self) -> None:
        self.bg.close(CLOSE_TIMEOUT)
        log.info("kvgraft: %s side counters %s", self.side, self.counters.snapshot())
        if self.registry is not None:
            self.registry.close()

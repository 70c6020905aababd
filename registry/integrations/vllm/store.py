"""The registry side of the connector: settings, prefix lookup for an engine identity,
verified chunk fetches, publishing computed prefixes and audit events."""

from __future__ import annotations

import logging
import os
import re
import struct
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgraft import __version__
from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import IncompatibleModel, UsageError
from kvgraft.formats.chunks import DEFAULT_CHUNK_TOKENS
from kvgraft.formats.kvfile import RawTensor, write_kvfile
from kvgraft.formats.manifest import BlobRef, Manifest
from kvgraft.integrations.prefetch import Observe, split_cached
from kvgraft.integrations.prefetch import prefetch as fetch_blobs
from kvgraft.integrations.restorecost import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    check_rate,
    check_restore_when,
)
from kvgraft.integrations.vllm.identity import EngineIdentity, other_layouts
from kvgraft.reference import Reference
from kvgraft.services.match import match
from kvgraft.services.prefixindex import RepositoryScope
from kvgraft.transfer.push import PushOptions

log = logging.getLogger("vllm.kvgraft")

DEFAULT_MEMORY_CACHE_MB = 512
_SETTINGS = ("home", "catalog_url", "blob_url", "cache_dir", "remote", "repository",
             "chunk_tokens", "publish", "restore", "allow_cross_engine", "queue_size",
             "min_tokens", "lookup_timeout", "memory_cache_mb", "restore_from", "salt_key",
             "restore_when", "prefill_tokens_per_s", "allow_cross_layout")


@dataclass(frozen=True, slots=True)
class Settings:
    """`kv_connector_extra_config`, checked: an unknown key is refused, not ignored."""

    overrides: Mapping[str, Any]  # Config overrides (home, catalog_url, blob_url, cache_dir)
    remote: str | None = None
    repository: str | None = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    publish: bool | None = None  # default: the kv_role produces
    restore: bool | None = None  # default: the kv_role consumes
    allow_cross_engine: bool = False
    queue_size: int = 8
    min_tokens: int = 0  # shorter prompts are neither looked up nor published
    # seconds a request waits for its lookup and first fetch before computing its prefill
    lookup_timeout: float = 5.0
    # verified chunks the worker keeps in memory for the next restore (0: none)
    memory_cache_mb: int = DEFAULT_MEMORY_CACHE_MB
    # repositories (names or shell patterns) restores are looked up in; () is the
    # publishing repository only
    restore_from: tuple[str, ...] = ()
    # HMAC key of cache_salt digests (keying.salt_key); a secret, never shown
    salt_key: str | None = field(default=None, repr=False)
    # "faster": restore only when the estimate says it beats computing the prefill
    # (kvgraft.integrations.restorecost); "always": whenever the registry has a prefix
    restore_when: str = "faster"
    # the prefill rate assumed until the engine computed a prompt
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    # also restore grafts published at another tensor-parallel size (approximate)
    allow_cross_layout: bool = False

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> Settings:
        unknown = sorted(set(extra) - set(_SETTINGS))
        if unknown:
            raise UsageError(f"unknown kvgraft connector settings {unknown}; "
                             f"known: {', '.join(_SETTINGS)}")
        overrides = {k: (Path(str(extra[k])) if k in ("home", "cache_dir") else str(extra[k]))
                     for k in ("home", "catalog_url", "blob_url", "cache_dir") if k in extra}
        try:
            timeout = float(extra.get("lookup_timeout", 5.0))
        except (TypeError, ValueError):
            timeout = float("nan")
        if not timeout > 0:  # NaN too
            raise UsageError(f"lookup_timeout must be a positive number of seconds, "
                             f"not {extra['lookup_timeout']!r}")
        memory = extra.get("memory_cache_mb", DEFAULT_MEMORY_CACHE_MB)
        if isinstance(memory, bool) or not isinstance(memory, int) or memory < 0:
            raise UsageError(f"memory_cache_mb must be a whole number of MiB, 0 or more, "
                             f"not {memory!r}")
        return cls(overrides, extra.get("remote"), extra.get("repository"),
                   int(extra.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)), extra.get("publish"),
                   extra.get("restore"), _flag(extra, "allow_cross_engine"),
                   int(extra.get("queue_size", 8)), int(extra.get("min_tokens", 0)),
                   timeout, memory, _patterns(extra.get("restore_from", ())),
                   _secret(extra.get("salt_key")),
                   check_restore_when(extra.get("restore_when", "faster")),
                   check_rate("prefill_tokens_per_s",
                              extra.get("prefill_tokens_per_s", DEFAULT_PREFILL_TOKENS_PER_S)),
                   _flag(extra, "allow_cross_layout"))

    def scope(self, repository: str) -> RepositoryScope:
        return RepositoryScope(self.restore_from or (repository,))

    def open(self) -> Registry:
        from kvgraft.config import Config

        # `home` stands for KVGRAFT_HOME: the catalog, store and remotes it implies follow it
        env = dict(os.environ)
        if "home" in self.overrides:
            env["KVGRAFT_HOME"] = str(self.overrides["home"])
        return Registry(Config.from_env(env, remote=self.remote, **self.overrides))


def _patterns(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(
            isinstance(p, str) and p.strip() for p in items):
        raise UsageError(f"restore_from must be a repository name or pattern, or a list of "
                         f"them, not {value!r}")
    return tuple(p.strip() for p in items)


def _flag(extra: Mapping[str, Any], name: str) -> bool:
    value = extra.get(name, False)
    if not isinstance(value, bool):
        raise UsageError(f"{name} must be true or false, not {value!r}")
    return value


def _secret(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) < 16:
        raise UsageError("salt_key must be a string of at least 16 characters")
    return value


def aligned_chunk_tokens(chunk_tokens: int, block_size: int) -> int:
    """The chunk size published: the configured one rounded up to whole blocks, so every
    chunk covers whole vLLM blocks and a restore writes whole blocks."""
    return max(block_size, -(-chunk_tokens // block_size) * block_size)


def default_repository(name: str) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", Path(name).name.lower()).strip("-") or "model"
    return f"vllm/{base}"


def check_policy(registry: Registry, repository: str, digest: Digest, manifest: Manifest) -> None:
    """The registry's pull policy (signatures, verification) applies to restores too."""
    registry.check_policy(Reference(repository, digest=digest), manifest, action="vllm-restore")


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What the worker loads: tokens [start, end) of `digest`, from `chunks`."""

    digest: str
    end: int
    chunks: tuple[tuple[int, int, str, int], ...]  # (start, end, digest, size)
    cross: str | None  # None: exact; "engine" or "layout": an approximate restore
    covered: int  # prompt tokens the graft covers (before block alignment)


def lookup(registry: Registry, ident: EngineIdentity, token_ids: Sequence[int],
           allow_cross_engine: bool, scope: RepositoryScope | None = None,
           allow_cross_layout: bool = False) -> tuple[Manifest, int, str | None] | None:
    """(manifest, tokens covered, None or what the restore crosses: "layout", "engine") of
    the graft with the longest prefix of `token_ids` this engine may restore, among the
    grafts tagged in a repository `scope` accepts (None: any the registry can read). The
    engine's own grafts first: an exact restore wins over a longer approximate one."""
    candidates: list[tuple[Any, str | None]] = [(ident.identity, None)]
    if allow_cross_layout:
        candidates += [(other.identity, "layout") for other in other_layouts(ident)]
    if allow_cross_engine:
        candidates.append((ident.plain, "engine"))
    for identity, cross in candidates:
        m = match(registry, identity, token_ids, repositories=scope)
        if m is None:
            continue
        manifest = registry.manifest(m.digest)
        check_layout(manifest, ident, identity)
        return manifest, m.length, cross
    return None


def check_layout(manifest: Manifest, ident: EngineIdentity, identity: Any) -> None:
    """Refuse a graft whose identity or tensors do not fit this engine's paged cache."""
    if manifest.model != identity:
        raise IncompatibleModel(f"graft {manifest.digest} is for another model")
    if len(manifest.layers) != ident.layers:
        raise IncompatibleModel(f"graft has {len(manifest.layers)} layers, engine {ident.layers}")
    for layer in manifest.layers:
        if (layer.start, layer.dtype, layer.kv_heads, layer.key_dim, layer.value_dim) != (
                0, ident.kv_dtype, ident.kv_heads, ident.head_dim, ident.head_dim):
            raise IncompatibleModel(f"graft layer {layer.index} does not fit the paged cache")
    if manifest.chunk_tokens % ident.block_size:
        raise IncompatibleModel(f"graft chunks of {manifest.chunk_tokens} tokens do not cover "
                                f"whole blocks of {ident.block_size}")


def plan_restore(manifest: Manifest, end: int, covered: int, cross: str | None,
                 ) -> RestorePlan:
    chunks = tuple((c.start, c.end, str(c.digest), c.size) for c in manifest.chunks
                   if c.start < end)
    return RestorePlan(str(manifest.digest), end, chunks, cross, covered)


def chunk_refs(plan: RestorePlan) -> list[BlobRef]:
    return [BlobRef(Digest.parse(digest), size) for _, _, digest, size in plan.chunks]


def missing(registry: Registry, plan: RestorePlan) -> tuple[list[int], int]:
    """(sizes of the plan's chunks the machine cache lacks, bytes of those it holds)."""
    lacking, cached = split_cached(registry, chunk_refs(plan))
    return [r.size for r in lacking], cached


def prefetch(registry: Registry, plan: RestorePlan, observe: Observe | None = None) -> int:
    """Bring the plan's chunks into the machine cache, each verified, kept decoded (a
    restore then only hashes them); bytes fetched."""
    return fetch_blobs(registry, chunk_refs(plan), observe, keep_decoded=True)


def event(registry: Registry, action: str, digest: str | None, outcome: str,
          detail: Mapping[str, Any], repository: str | None = None) -> None:
    registry.events.record(action, digest=Digest.parse(digest) if digest else None,
                           outcome=outcome, repository=repository, detail=dict(detail))


def graft_tag(ident: EngineIdentity, tokens: Digest) -> str:
    """`t-<tokens>`, and for a keyed request `-<identity>` after it: one prompt published
    with the base model and with an adapter (or two salts) makes two grafts, each tagged."""
    tag = f"t-{tokens.hex[:32]}"
    return f"{tag}-{ident.identity.key.hex[:16]}" if ident.config.get("request") else tag


def publish(registry: Registry, ident: EngineIdentity, repository: str, chunk_tokens: int,
            token_ids: Sequence[int], layers: Sequence[tuple[Any, Any]]) -> Digest:
    """Store the KV of `token_ids` (per layer, key and value [kv_heads, tokens, head_dim]
    tensors) as a graft tagged by its token digest. The provenance holds no time or host
    (those are the push event's), so two nodes publishing the same prefix with the same
    engine make the same bytes: one artifact, every blob stored once."""
    import torch

    token_bytes = struct.pack(f"<{len(token_ids)}q", *token_ids)
    tokens_digest = Digest.of(token_bytes)
    raw: list[tuple[RawTensor, RawTensor, int]] = []
    for k, v in layers:
        kb = memoryview(k.reshape(-1).view(torch.uint8).numpy())
        vb = memoryview(v.reshape(-1).view(torch.uint8).numpy())
        raw.append((RawTensor(ident.kv_dtype, tuple(k.shape), kb),
                    RawTensor(ident.kv_dtype, tuple(v.shape), vb), 0))
    # No per-tensor digests: the push hashes every byte once, into the chunk digests the
    # manifest holds, and a second pass here would double a publish's hashing.
    provenance = {"kvgraft": __version__, "engine": ident.engine,
                  "input": {"token_ids": str(tokens_digest), "token_count": len(token_ids),
                            "text": None},
                  "output": {}, "parents": []}
    if ident.config.get("request"):  # what besides the tokens the KV was computed with
        provenance["request"] = ident.config["request"]
    tmp_dir = registry.config.cache_dir / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="vllm-", suffix=".kv", dir=tmp_dir)
    os.close(fd)
    try:
        path = write_kvfile(name, raw, token_bytes, ident.identity, model_name=ident.name,
                            model_config=ident.config, provenance=provenance)
        result = registry.push(path, Reference(repository, tag=graft_tag(ident, tokens_digest)),
                               options=PushOptions(chunk_tokens=chunk_tokens))
    finally:
        Path(name).unlink(missing_ok=True)
    return result.digest

"""What a request adds to the engine's identity: everything besides its token ids that
changes the KV vLLM computes for it, as vLLM's own prefix cache keys its blocks
(`generate_block_hash_extra_keys`).

- LoRA adapter: the SHA-256 digest of the adapter's files, not its name or path (both are
  per deployment: two deployments may serve one adapter under two names, or one name for
  two adapters).
- `cache_salt`: an HMAC-SHA256 of the salt (the tenant) under the connector's salt key, so
  the salt is never stored; see `salt_key`.
- multimodal items and prompt embeddings: the request is neither restored nor published
  (`skip_reason`).

The key is folded into the architecture digest of the model identity a request's grafts
carry (the config gains a "request" field), as the engine is: the identity's key seeds
every prefix key, so a graft made for one key is never a candidate for another (a base
model's graft for an adapter request, one tenant's for another's), and the identity
check of a restore refuses it besides. The graft's recorded config and provenance name the
key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.digest import Digest, canonical_json
from kvgraft.errors import UsageError
from kvgraft.identity.fingerprint import architecture_digest
from kvgraft.identity.model import ModelIdentity
from kvgraft.integrations.vllm.identity import EngineIdentity

MAX_ADAPTER_FILES = 10_000  # an adapter directory larger than this is refused
SALT_KEY_CONTEXT = b"kvgraft vllm cache_salt key\x00"


@dataclass(frozen=True, slots=True)
class RequestKey:
    """A request's inputs besides its token ids, as digests (empty for a plain request)."""

    adapter: str | None = None  # "sha256:..." of the adapter's files
    salt: str | None = None  # "hmac-sha256:..." of the cache_salt

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in (("adapter", self.adapter), ("salt", self.salt)) if v}

    def __bool__(self) -> bool:
        return bool(self.adapter or self.salt)


PLAIN = RequestKey()


def skip_reason(request: Any) -> str | None:
    """Why a request is neither restored nor published, None when it may be.

    Multimodal: vLLM keys an item by its `identifier`, which a client may set itself
    (`multi_modal_uuids`); inside one engine that is one trust domain, but a registry shared
    by deployments and tenants would let one client name another's image and be served its
    KV. The encoder's output also depends on the processor's configuration, which the
    engine identity does not cover. Prompt embeddings: the KV depends on the embeddings'
    values, which the token ids (placeholders) do not carry."""
    if getattr(request, "mm_features", None):
        return "multimodal"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds"
    return None


def salt_key(configured: str | None, repository: str) -> bytes:
    """The HMAC key of `cache_salt` digests: the `salt_key` setting, else one derived from
    the publishing repository's name. A derived key is known to anyone who knows the
    repository's name: it hides a high-entropy salt (what vLLM asks tenants to use) but a
    guessable one can be tested against the catalog; set `salt_key` to a secret shared by
    the deployments that share grafts to close that."""
    material = configured.encode() if configured else repository.encode()
    return hashlib.sha256(SALT_KEY_CONTEXT + material).digest()


def salt_digest(key: bytes, salt: str) -> str:
    return "hmac-sha256:" + hmac.new(key, salt.encode(), hashlib.sha256).hexdigest()


def adapter_files(root: Path) -> list[Path]:
    if not root.is_dir():
        raise UsageError(f"LoRA adapter {root} is not a directory")
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not files or len(files) > MAX_ADAPTER_FILES:
        raise UsageError(f"LoRA adapter {root} has {len(files)} files")
    return files


def adapter_digest(root: Path) -> str:
    """SHA-256 over the adapter's files: each relative path with its content's digest."""
    entries = []
    for p in adapter_files(root):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        entries.append([p.relative_to(root).as_posix(), "sha256:" + h.hexdigest()])
    return str(Digest.of(canonical_json(entries)))


def adapter_path(lora_request: Any) -> Path:
    """The local directory vLLM loads a LoRA request's adapter from."""
    from vllm.lora.utils import get_adapter_absolute_path

    return Path(get_adapter_absolute_path(str(lora_request.lora_path)))


class Keys:
    """A side's request keys and keyed identities, each computed once (adapters hashed once
    per directory and file state; identities once per key)."""

    def __init__(self, salt_hmac_key: bytes) -> None:
        self._salt_key = salt_hmac_key
        self._adapters: dict[tuple[str, tuple[Any, ...]], str] = {}
        self._identities: dict[tuple[str, RequestKey], EngineIdentity] = {}
        self._lock = threading.Lock()

    def key(self, lora_request: Any, cache_salt: str | None) -> RequestKey:
        adapter = self._adapter(adapter_path(lora_request)) if lora_request else None
        salt = salt_digest(self._salt_key, cache_salt) if cache_salt else None
        return RequestKey(adapter, salt)

    def _adapter(self, root: Path) -> str:
        stamp = tuple((str(p), st.st_size, st.st_mtime_ns, st.st_ino)
                      for p in adapter_files(root) for st in (os.stat(p),))
        cache_key = (str(root), stamp)
        with self._lock:
            known = self._adapters.get(cache_key)
        if known is None:
            known = adapter_digest(root)
            with self._lock:
                self._adapters[cache_key] = known
        return known

    def identity(self, ident: EngineIdentity, key: RequestKey) -> EngineIdentity:
        if not key:
            return ident
        cache_key = (str(ident.identity.key), key)
        with self._lock:
            known = self._identities.get(cache_key)
        if known is None:
            known = keyed_identity(ident, key)
            with self._lock:
                self._identities[cache_key] = known
        return known


def keyed_identity(ident: EngineIdentity, key: RequestKey) -> EngineIdentity:
    """`ident` for requests with `key`: the key in the config the architecture digest
    covers, for the engine's identity and for the plain (cross-engine) one alike."""
    if not key:
        return ident
    request = key.to_json()
    config = {**ident.config, "request": request}
    plain_config = {k: v for k, v in ident.config.items() if k != "engine"}
    plain_config["request"] = request
    return dataclasses.replace(
        ident, config=config,
        identity=ModelIdentity(architecture_digest(config), ident.identity.tokenizer,
                               ident.identity.weights),
        plain=ModelIdentity(architecture_digest(plain_config), ident.plain.tokenizer,
                            ident.plain.weights))

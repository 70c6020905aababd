"""Prefix keys: chain_c = sha256(chain_{c-1} ‖ model identity ‖ token ids of span c).

A prefix key names "the KV of exactly these tokens under this model", so prefix lookup is
an indexed equality query on chunk rows, never a scan of token ids.
"""

from __future__ import annotations

import hashlib

from kvgraft.digest import Buffer, Digest
from kvgraft.identity import ModelIdentity

_SEED = bytes(32)
TOKEN_BYTES = 8  # token ids are int64 little-endian


def prefix_keys(identity: ModelIdentity, token_bytes: Buffer, chunk_tokens: int) -> list[Digest]:
    """One key per chunk of `chunk_tokens` tokens (the last one may be shorter)."""
    view = memoryview(token_bytes)
    model = identity.key.raw
    prev = _SEED
    keys = []
    step = chunk_tokens * TOKEN_BYTES
    for lo in range(0, view.nbytes, step):
        h = hashlib.sha256(prev)
        h.update(model)
        h.update(view[lo : lo + step])
        prev = h.digest()
        keys.append(Digest(prev.hex()))
    return keys

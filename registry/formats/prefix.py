"""Prefix keys: chain_c = sha256(chain_{c-1} ‖ model identity ‖ token ids of span c).

A prefix key names "the KV of exactly these tokens under this model", so prefix lookup is
an indexed equality query on chunk rows, never a scan of token ids.
"""

from __future__ import annotations

import hashlib

from kvgraft.digest import Buffer, Digest
from kvgraft.identity.model import ModelIdentity

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


def tail_keys(identity: ModelIdentity, token_bytes: Buffer, after: Digest | None,
              start: int, count: int) -> list[Digest]:
    """The keys of a last, partial chunk of 1..`count` tokens starting at token `start`,
    chained after the key `after` (None at the start): key r-1 names the first r of them.
    A graft's last chunk is shorter than the chunk size unless it divides the token count,
    so these find a graft the query extends by its own last key."""
    return [Digest(h) for h in tail_key_hexes(identity, token_bytes, after, start, count)]


def tail_key_hexes(identity: ModelIdentity, token_bytes: Buffer, after: Digest | None,
                   start: int, count: int) -> list[str]:
    """`tail_keys` as hex strings: a lookup sends up to c-1 of them to the catalog as they
    are, and checking each one's form again cost more than hashing it."""
    view = memoryview(token_bytes)
    prev = bytes.fromhex(after.hex) if after is not None else _SEED
    # Key r-1 hashes what key r-2 hashed plus one token: one running hash, copied at each
    # length, costs c token updates instead of the c²/2 of hashing every span afresh.
    h = hashlib.sha256(prev)
    h.update(identity.key.raw)
    keys = []
    for lo in range(start * TOKEN_BYTES, (start + count) * TOKEN_BYTES, TOKEN_BYTES):
        h.update(view[lo : lo + TOKEN_BYTES])
        keys.append(h.copy().hexdigest())
    return keys

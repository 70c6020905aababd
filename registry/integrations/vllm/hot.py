"""Restored chunks kept in the worker's memory, as vLLM's blocks hold them, least recently
used first out.

A graft that serves recurring requests is restored again and again. Reading a chunk back
from the machine cache means hashing it again (the cache is a file anyone on the machine
can write), and converting a KV file's [kv_heads, tokens, head_dim] into the blocks' layout
(keys transposed or packed) cost more than copying the same bytes. So once a chunk is
verified and written into vLLM's blocks, the worker keeps a copy of those blocks' bytes:
they are as trustworthy as vLLM's own KV, and the next restore of the chunk is a copy per
run of blocks. An entry is in this worker's layout (its layers, its KV heads, its block
size), which never changes while it runs. Content addressing makes an entry immutable: a
digest always names the same bytes, so nothing is ever invalidated, only evicted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the worker has torch; this module does not need it
    from kvgraft.integrations.vllm.paged import Rows

MiB = 1 << 20


class HotChunks:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = max(0, capacity_bytes)
        self._entries: OrderedDict[str, Rows] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, digest: str) -> Rows | None:
        with self._lock:
            rows = self._entries.get(digest)
            if rows is None:
                self.misses += 1
                return None
            self._entries.move_to_end(digest)
            self.hits += 1
            return rows

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    def put(self, digest: str, rows: Rows) -> None:
        """Keep `rows` (never written again by the caller) under `digest`."""
        size = sum(r.nbytes for r in rows)
        if not self.fits(size):
            return
        with self._lock:
            if digest in self._entries:
                return
            self._entries[digest] = rows
            self._size += size
            while self._size > self.capacity:
                _, old = self._entries.popitem(last=False)
                self._size -= sum(r.nbytes for r in old)

    @property
    def size(self) -> int:
        return self._size

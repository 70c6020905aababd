"""Verified chunks kept in the worker's memory, least recently used first out.

A graft that serves recurring requests is restored again and again. Reading a chunk back
from the machine cache means hashing it again (the cache is a file anyone on the machine
can write), which cost more than copying it into vLLM's blocks. Bytes that were verified
when they entered this process's memory are as trustworthy as vLLM's own KV blocks, so a
restore from here only copies. Content addressing makes an entry immutable: a digest always
names the same bytes, so nothing is ever invalidated, only evicted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MiB = 1 << 20


class HotChunks:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = max(0, capacity_bytes)
        self._entries: OrderedDict[str, bytearray] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, digest: str) -> bytearray | None:
        with self._lock:
            data = self._entries.get(digest)
            if data is None:
                self.misses += 1
                return None
            self._entries.move_to_end(digest)
            self.hits += 1
            return data

    def put(self, digest: str, data: bytearray) -> None:
        """Keep `data` (verified, never written again by the caller) under `digest`."""
        if len(data) > self.capacity:
            return
        with self._lock:
            if digest in self._entries:
                return
            self._entries[digest] = data
            self._size += len(data)
            while self._size > self.capacity:
                _, old = self._entries.popitem(last=False)
                self._size -= len(old)

    @property
    def size(self) -> int:
        return self._size

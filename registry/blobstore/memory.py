"""`memory://name`: an in-process store for unit tests; stores of one name are shared."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from kvgraft.blobstore.base import BlobInfo, too_large
from kvgraft.digest import Buffer, Digest
from kvgraft.errors import NotFound

_STORES: dict[str, dict[Digest, tuple[bytes, float]]] = {}
_LOCK = threading.Lock()


class MemoryBlobStore:
    def __init__(self, name: str = "") -> None:
        self.name = name
        with _LOCK:
            self._blobs = _STORES.setdefault(name, {})

    @property
    def url(self) -> str:
        return f"memory://{self.name}"

    def exists(self, digest: Digest) -> bool:
        return digest in self._blobs

    def stat(self, digest: Digest) -> BlobInfo | None:
        entry = self._blobs.get(digest)
        return None if entry is None else BlobInfo(digest, len(entry[0]), entry[1])

    def put(self, digest: Digest, parts: Sequence[Buffer]) -> bool:
        data = b"".join(parts)
        with _LOCK:
            if digest in self._blobs:
                return False
            self._blobs[digest] = (data, time.time())
        return True

    def replace(self, digest: Digest, parts: Sequence[Buffer]) -> None:
        with _LOCK:
            self._blobs[digest] = (b"".join(parts), time.time())

    def get(self, digest: Digest, max_size: int | None = None) -> bytes:
        entry = self._blobs.get(digest)
        if entry is None:
            raise NotFound(f"blob {digest} is not in {self.url}")
        if max_size is not None and len(entry[0]) > max_size:
            raise too_large(digest, self.url, len(entry[0]), max_size)
        return entry[0]

    def open(self, digest: Digest) -> BinaryIO:
        return io.BytesIO(self.get(digest))

    def delete(self, digest: Digest) -> bool:
        with _LOCK:
            return self._blobs.pop(digest, None) is not None

    def iter(self) -> Iterator[BlobInfo]:
        for digest, (data, mtime) in sorted(self._blobs.items()):
            yield BlobInfo(digest, len(data), mtime)

    def corrupt(self, digest: Digest, data: bytes) -> None:
        """Replace a stored blob's bytes behind the store's back (hostile tests only)."""
        self._blobs[digest] = (data, self._blobs[digest][1])

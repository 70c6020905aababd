"""The per-machine pull cache: verified decoded blobs and manifests under $KVGRAFT_CACHE.

Entries are written by unique temp file + rename and re-verified on every read, so a torn
or tampered entry is dropped and fetched again; no lock is needed for correctness.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from registry.blobstore.base import blob_path
from registry.blobstore.local import LocalBlobStore
from registry.codec import RawCodec, decode_blob, frame
from registry.digest import Buffer, Digest
from registry.errors import IntegrityError
from registry.fsutil import atomic_writer


class Cache:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = LocalBlobStore(root / "blobs", durable=False)
        self._raw = RawCodec()

    def get(self, digest: Digest, size: int) -> Buffer | None:
        """The verified decoded blob, or None (a bad entry is removed)."""
        try:
            stored = self.blobs.get(digest)
        except LookupError:
            return None
        try:
            _, data = decode_blob(stored, size)
            digest.check(Digest.of(data), f"cached blob {digest}")
        except IntegrityError:
            self.blobs.delete(digest)
            return None
        return data

    def put(self, digest: Digest, data: Buffer) -> None:
        self.blobs.put(digest, frame(self._raw, data))

    def has(self, digest: Digest) -> bool:
        return self.blobs.exists(digest)

    def _manifest_path(self, digest: Digest) -> Path:
        return self.root / "manifests" / blob_path(digest)

    def put_manifest(self, digest: Digest, raw: bytes) -> None:
        path = self._manifest_path(digest)
        if not path.is_file():
            with atomic_writer(path, durable=False) as f:
                f.write(raw)

    def get_manifest(self, digest: Digest) -> bytes | None:
        path = self._manifest_path(digest)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        if Digest.of(raw) != digest:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return None
        return raw

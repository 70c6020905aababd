"""`file:///dir`: blobs as files under dir/sha256/ab/cdef…, written by atomic rename."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from kvgraft.blobstore.base import BlobInfo, blob_path, too_large
from kvgraft.digest import Buffer, Digest
from kvgraft.errors import IntegrityError, NotFound, Unavailable, UsageError
from kvgraft.fsutil import atomic_writer, create_exclusive, open_regular


class LocalBlobStore:
    def __init__(self, root: Path, *, durable: bool = True) -> None:
        self.root = root.absolute()
        # A cache whose every read is verified can skip fsync: a torn file after a crash
        # is detected and fetched again. The registry's own store is always durable.
        self.durable = durable

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def _path(self, digest: Digest) -> Path:
        return self.root / blob_path(digest)

    def exists(self, digest: Digest) -> bool:
        return self._path(digest).is_file()

    def stat(self, digest: Digest) -> BlobInfo | None:
        try:
            st = self._path(digest).stat()
        except FileNotFoundError:
            return None
        return BlobInfo(digest, st.st_size, st.st_mtime)

    def put(self, digest: Digest, parts: Sequence[Buffer]) -> bool:
        target = self._path(digest)
        if target.is_file():
            return False
        try:
            return create_exclusive(target, parts, durable=self.durable)
        except OSError as e:
            raise Unavailable(f"cannot write blob {digest} under {self.root}: {e}") from None

    def replace(self, digest: Digest, parts: Sequence[Buffer]) -> None:
        # rename() swaps the directory entry (even a symlink planted there) atomically;
        # open readers keep the old inode.
        try:
            with atomic_writer(self._path(digest), durable=self.durable) as f:
                for p in parts:
                    f.write(p)
        except OSError as e:
            raise Unavailable(f"cannot repair blob {digest} under {self.root}: {e}") from None

    def get(self, digest: Digest, max_size: int | None = None) -> bytes:
        fd, st = self._open(digest)
        with os.fdopen(fd, "rb") as f:
            if max_size is None:
                return f.read()
            if st.st_size > max_size:
                raise too_large(digest, self.url, st.st_size, max_size)
            data = f.read(max_size + 1)  # bounded even if the file grows under us
        if len(data) > max_size:
            raise too_large(digest, self.url, len(data), max_size)
        return data

    def open(self, digest: Digest) -> BinaryIO:
        fd, _ = self._open(digest)
        return os.fdopen(fd, "rb")

    def _open(self, digest: Digest) -> tuple[int, os.stat_result]:
        # A blob replaced by a symlink to /dev/zero or a FIFO must fail, not hang or
        # fill memory.
        try:
            return open_regular(self._path(digest), f"blob {digest} in", IntegrityError)
        except FileNotFoundError:
            raise NotFound(f"blob {digest} is not in {self.url}") from None

    def delete(self, digest: Digest) -> bool:
        try:
            os.unlink(self._path(digest))
        except FileNotFoundError:
            return False
        return True

    def iter(self) -> Iterator[BlobInfo]:
        base = self.root / "sha256"
        if not base.is_dir():
            return
        for fan in sorted(base.iterdir()):
            for entry in sorted(fan.iterdir()):
                if entry.name.startswith("."):
                    continue  # a writer's temp file, not a blob
                with contextlib.suppress(UsageError, FileNotFoundError):
                    digest = Digest(fan.name + entry.name)
                    st = entry.stat()
                    yield BlobInfo(digest, st.st_size, st.st_mtime)

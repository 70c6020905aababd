"""`file:///dir`: blobs as files under dir/sha256/ab/cdef…, written by atomic rename."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from kvgraft.blobstore.base import BlobInfo, blob_path, too_large
from kvgraft.digest import Buffer, Digest
from kvgraft.errors import IntegrityError, NotFound, Unavailable, UsageError
from kvgraft.fsutil import atomic_writer, create_exclusive, open_regular


def _failed(action: str, path: Path, e: OSError) -> Unavailable:
    """A permission or I/O error in the store: the store is unusable at `path`, which the
    message names so that whoever runs it can look."""
    reason = e.strerror or type(e).__name__
    return Unavailable(f"cannot {action} {path}: {reason}",
                       hint="check that path's permissions, type and disk")


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
        path = self._path(digest)
        try:
            return path.is_file()
        except OSError as e:
            raise _failed("look at blob", path, e) from None

    def stat(self, digest: Digest) -> BlobInfo | None:
        path = self._path(digest)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _failed("look at blob", path, e) from None
        return BlobInfo(digest, st.st_size, st.st_mtime)

    def put(self, digest: Digest, parts: Sequence[Buffer]) -> bool:
        target = self._path(digest)
        try:
            if target.is_file():
                return False
            return create_exclusive(target, parts, durable=self.durable)
        except OSError as e:
            raise _failed("write blob", target, e) from None

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
                try:
                    return f.read()
                except OSError as e:
                    raise _failed("read blob", self._path(digest), e) from None
            if st.st_size > max_size:
                raise too_large(digest, self.url, st.st_size, max_size)
            try:
                data = f.read(max_size + 1)  # bounded even if the file grows under us
            except OSError as e:
                raise _failed("read blob", self._path(digest), e) from None
        if len(data) > max_size:
            raise too_large(digest, self.url, len(data), max_size)
        return data

    def open(self, digest: Digest) -> BinaryIO:
        fd, _ = self._open(digest)
        return os.fdopen(fd, "rb")

    def _open(self, digest: Digest) -> tuple[int, os.stat_result]:
        # A blob replaced by a symlink to /dev/zero or a FIFO must fail, not hang or
        # fill memory.
        path = self._path(digest)
        try:
            return open_regular(path, f"blob {digest} in", IntegrityError)
        except FileNotFoundError:
            raise NotFound(f"blob {digest} is not in {self.url}") from None
        except OSError as e:
            raise _failed("read blob", path, e) from None

    def delete(self, digest: Digest) -> bool:
        path = self._path(digest)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _failed("delete blob", path, e) from None
        return True

    def iter(self) -> Iterator[BlobInfo]:
        base = self.root / "sha256"
        if not base.is_dir():
            return
        for fan in _listing(base):
            if not fan.is_dir():
                continue  # a foreign file, not a fan-out directory
            for entry in _listing(fan):
                if entry.name.startswith("."):
                    continue  # a writer's temp file, not a blob
                try:
                    digest = Digest(fan.name + entry.name)
                    st = entry.stat()
                except (UsageError, FileNotFoundError):
                    continue  # not named like a blob, or deleted since the listing
                except OSError as e:
                    raise _failed("look at blob", entry, e) from None
                yield BlobInfo(digest, st.st_size, st.st_mtime)


def _listing(directory: Path) -> list[Path]:
    try:
        return sorted(directory.iterdir())
    except OSError as e:
        raise _failed("list", directory, e) from None

"""Open blob uploads: one data file and one JSON file per upload under the server's upload
directory, so every worker of a server sees the same uploads. Nothing reaches the blob
store until the whole blob is there and its digest checked (kvgraft.server.content)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvgraft.server.errors import OciError

_ID_LEN = 32


@dataclass(frozen=True, slots=True)
class Upload:
    id: str
    repository: str
    data: Path

    @property
    def size(self) -> int:
        return self.data.stat().st_size


def owner_key(owner: str) -> str:
    """A file-name-safe key for who opened an upload (a token's name)."""
    return hashlib.sha256(owner.encode()).hexdigest()[:16]


class Uploads:
    """Open uploads are limited in all (`max_open`) and per token (`max_per_owner`), so one
    token holding its share leaves the rest to others; an upload nothing was written to for
    `ttl` seconds is removed (its slot with it) by the next one admitted."""

    def __init__(self, root: Path, *, max_open: int, max_per_owner: int, max_bytes: int,
                 ttl: float) -> None:
        self.root = root
        self.max_open = max_open
        self.max_per_owner = min(max_per_owner, max_open)
        self.max_bytes = max_bytes
        self.ttl = ttl
        root.mkdir(parents=True, exist_ok=True)

    def _meta(self, upload_id: str) -> Path:
        return self.root / f"{upload_id}.json"

    def _data(self, upload_id: str) -> Path:
        return self.root / f"{upload_id}.data"

    def _admit(self, owner: str) -> str:
        """Room for one more upload by `owner`, or 429; returns the owner's key."""
        self._expire()
        key = owner_key(owner)
        owners = [self._owner(meta) for meta in self.root.glob("*.json")] + \
            [p.name.split("-")[1] for p in self.root.glob(".mono-*")]
        if len(owners) >= self.max_open:
            raise OciError(429, "TOOMANYREQUESTS",
                           f"too many open uploads (limit {self.max_open}); retry later")
        if owners.count(key) >= self.max_per_owner:
            raise OciError(429, "TOOMANYREQUESTS",
                           f"this token has {self.max_per_owner} open uploads, its limit: "
                           "finish or cancel one, or retry later")
        return key

    @staticmethod
    def _owner(meta: Path) -> str:
        try:
            return str(json.loads(meta.read_text()).get("owner", ""))
        except (OSError, ValueError):
            return ""

    def start(self, repository: str, owner: str) -> Upload:
        key = self._admit(owner)
        upload_id = uuid.uuid4().hex
        self._data(upload_id).touch(exist_ok=False)
        meta = json.dumps({"repository": repository, "owner": key, "started": time.time()})
        tmp = self.root / f".{upload_id}.tmp"
        tmp.write_text(meta)
        os.replace(tmp, self._meta(upload_id))
        return Upload(upload_id, repository, self._data(upload_id))

    def get(self, repository: str, upload_id: str) -> Upload:
        unknown = OciError(404, "BLOB_UPLOAD_UNKNOWN", f"no upload {upload_id[:40]!r} in "
                           f"{repository}")
        if len(upload_id) != _ID_LEN or not all(c in "0123456789abcdef" for c in upload_id):
            raise unknown
        try:
            meta = json.loads(self._meta(upload_id).read_text())
        except FileNotFoundError:
            raise unknown from None
        if meta.get("repository") != repository or not self._data(upload_id).exists():
            raise unknown
        return Upload(upload_id, repository, self._data(upload_id))

    @contextlib.contextmanager
    def locked(self, upload: Upload) -> Iterator[int]:
        """The upload's data file open for appending, locked against other requests;
        yields the file descriptor."""
        try:
            fd = os.open(upload.data, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            raise OciError(404, "BLOB_UPLOAD_UNKNOWN", f"upload {upload.id} is gone") from None
        try:
            # Never wait: the lock is taken on the event loop, and two requests writing one
            # upload at once is a client error anyway.
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OciError(416, "BLOB_UPLOAD_INVALID",
                               f"upload {upload.id} is being written by another request"
                               ) from None
            yield fd
        finally:
            os.close(fd)

    def finish(self, upload: Upload) -> None:
        for path in (self._meta(upload.id), self._data(upload.id)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def scratch(self, owner: str) -> Path:
        """A private file for a monolithic upload (counted like an open upload)."""
        key = self._admit(owner)
        return self.root / f".mono-{key}-{uuid.uuid4().hex}"

    def _expire(self) -> None:
        # Idle, not age: an upload still being written keeps its slot however long it
        # takes, one left behind loses it after `ttl`. A monolithic upload's file outlives
        # its request only if the server died in it.
        cutoff = time.time() - self.ttl
        for scratch in self.root.glob(".mono-*"):
            with contextlib.suppress(OSError):
                if scratch.stat().st_mtime < cutoff:
                    scratch.unlink()
        for meta in self.root.glob("*.json"):
            with contextlib.suppress(OSError):
                data = self._data(meta.stem)
                last = max(meta.stat().st_mtime, data.stat().st_mtime if data.exists() else 0)
                if last < cutoff:
                    self.finish(Upload(meta.stem, "", data))

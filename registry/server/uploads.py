"""Open blob uploads: one data file and one JSON file per upload under the server's upload
directory, so every worker of a server sees the same uploads. Nothing reaches the blob
store until the whole blob is there and its digest checked (kvgraft.server.content)."""

from __future__ import annotations

import contextlib
import fcntl
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


class Uploads:
    def __init__(self, root: Path, *, max_open: int, max_bytes: int, ttl: float) -> None:
        self.root = root
        self.max_open = max_open
        self.max_bytes = max_bytes
        self.ttl = ttl
        root.mkdir(parents=True, exist_ok=True)

    def _meta(self, upload_id: str) -> Path:
        return self.root / f"{upload_id}.json"

    def _data(self, upload_id: str) -> Path:
        return self.root / f"{upload_id}.data"

    def _admit(self) -> None:
        self._expire()
        open_now = sum(1 for _ in self.root.glob("*.json")) + \
            sum(1 for _ in self.root.glob(".mono-*"))
        if open_now >= self.max_open:
            raise OciError(429, "TOOMANYREQUESTS",
                           f"too many open uploads (limit {self.max_open}); retry later")

    def start(self, repository: str) -> Upload:
        self._admit()
        upload_id = uuid.uuid4().hex
        self._data(upload_id).touch(exist_ok=False)
        meta = json.dumps({"repository": repository, "started": time.time()})
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

    def scratch(self) -> Path:
        """A private file for a monolithic upload (counted like an open upload)."""
        self._admit()
        return self.root / f".mono-{uuid.uuid4().hex}"

    def _expire(self) -> None:
        cutoff = time.time() - self.ttl
        # a monolithic upload's file outlives its request only if the server died in it
        for scratch in self.root.glob(".mono-*"):
            with contextlib.suppress(OSError):
                if scratch.stat().st_mtime < cutoff:
                    scratch.unlink()
        for meta in self.root.glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                if json.loads(meta.read_text()).get("started", 0) < cutoff:
                    self.finish(Upload(meta.stem, "", self._data(meta.stem)))

"""Choose a blob store by URL. Unknown schemes are refused, never guessed."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

from kvgraft.blobstore.base import BlobStore
from kvgraft.errors import MissingExtra, UsageError


def open_store(url: str) -> BlobStore:
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UsageError(f"file URLs name a local path, not a host: {url}")
        path = unquote(parts.path)
        if not path:
            raise UsageError(f"file URL without a path: {url}")
        from kvgraft.blobstore.local import LocalBlobStore

        return LocalBlobStore(Path(path))
    if parts.scheme in ("memory", "s3"):
        _check_prefix(url, parts.path)
    if parts.scheme == "memory":
        from kvgraft.blobstore.memory import MemoryBlobStore

        return MemoryBlobStore(parts.netloc + parts.path)
    if parts.scheme == "s3":
        try:
            from kvgraft.blobstore.s3 import S3BlobStore  # type: ignore[import-untyped,unused-ignore]
        except ImportError as e:
            if getattr(e, "name", "") and str(e.name).split(".")[0] in ("boto3", "botocore"):
                raise MissingExtra("an s3:// blob store", "s3") from None
            raise
        store: BlobStore = S3BlobStore.from_url(url)
        return store
    raise UsageError(
        f"unsupported blob store URL {url!r}", hint="use file:///dir, s3://bucket/prefix or memory://"
    )


def _check_prefix(url: str, path: str) -> None:
    """Object keys are not paths: `a/../b` is a key of its own on one server and `b` on
    another, so two stores could silently share or miss each other's blobs."""
    segments = path.strip("/").split("/")
    if path.strip("/") and any(s in ("", ".", "..") for s in segments):
        raise UsageError(f"store URL {url!r} has an empty, '.' or '..' segment in its prefix",
                         hint="write the prefix without them, e.g. s3://bucket/team/kv")

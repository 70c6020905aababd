"""Repair: replace stored blobs that failed verification with good bytes, taken from this
machine's cache (every cached blob is verified as it is read) or from the pushed KV file.

A blob is overwritten only after reading it back once more and finding it still bad (a
concurrent repair or push may have fixed it), and only with bytes that decode to its
digest; the store's `replace` is atomic, so readers see the bad blob or the good one.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvgraft.blobstore.base import BlobStore
from kvgraft.catalog.records import BlobRecord
from kvgraft.codecs.codec import DEFAULT_CODEC, codec_selector, frame
from kvgraft.digest import Digest
from kvgraft.errors import NotFound, UsageError
from kvgraft.formats.manifest import Manifest
from kvgraft.transfer.cache import Cache
from kvgraft.transfer.push import PushOptions, build_artifact, checked_record


def from_cache(manifest: Manifest, bad: Iterable[Digest], store: BlobStore,
               cache: Cache) -> tuple[list[BlobRecord], list[Digest]]:
    """(records of the blobs repaired or found good again, digests the cache lacks)."""
    sizes = {b.digest: b.size for b in manifest.blobs()}
    select = codec_selector(DEFAULT_CODEC)
    fixed: list[BlobRecord] = []
    missing: list[Digest] = []
    for digest in bad:
        size = sizes[digest]
        data = cache.get(digest, size)
        if data is None:
            missing.append(digest)
            continue
        try:
            record = checked_record(store, digest, size)
        except NotFound:
            record = None
        if record is None:
            codec = select(data)
            parts = frame(codec, data)
            store.replace(digest, parts)
            record = BlobRecord(digest, size, sum(memoryview(p).nbytes for p in parts),
                                codec.name)
        fixed.append(record)
    return fixed, missing


def from_file(manifest: Manifest, path: Path, store: BlobStore) -> list[BlobRecord]:
    """Push `path`'s blobs again (which replaces corrupt ones); it must be the very file
    the artifact was pushed from."""
    upload = build_artifact(path, store, PushOptions(chunk_tokens=manifest.chunk_tokens,
                                                     version=manifest.version))
    if upload.manifest.digest != manifest.digest:
        raise UsageError(f"{path} is not the file of artifact {manifest.digest} "
                         f"(it is {upload.manifest.digest})",
                         hint="give the KV file that was pushed, or repair from the cache")
    return list(upload.blobs)

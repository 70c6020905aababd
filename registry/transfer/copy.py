"""Copy an artifact between registries, transferring only the blobs the target lacks.

Stored blobs move as they are (same codec, same bytes) after being decoded and verified
against their keys, so a corrupt source blob never lands in the target.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvgraft.blobstore.base import BlobStore
from kvgraft.catalog.records import BlobRecord
from kvgraft.codecs.codec import max_stored_size, parse_frame
from kvgraft.formats.manifest import BlobRef, Manifest
from kvgraft.transfer.pull import verify_stored
from kvgraft.transfer.push import existing_record


@dataclass(frozen=True, slots=True)
class CopyStats:
    blobs: tuple[BlobRecord, ...]
    copied: int
    copied_bytes: int


def copy_blobs(manifest: Manifest, src: BlobStore, dst: BlobStore, *,
               workers: int = 4) -> CopyStats:
    def one(ref: BlobRef) -> tuple[BlobRecord, int]:
        existing = existing_record(dst, ref.digest, ref.size)
        if existing is not None:
            return existing, 0
        stored = src.get(ref.digest, max_stored_size(ref.size))
        verify_stored(ref, stored, src.url)
        name, _, _ = parse_frame(stored)
        dst.put(ref.digest, [stored])
        return BlobRecord(ref.digest, ref.size, len(stored), name), len(stored)

    with ThreadPoolExecutor(workers, thread_name_prefix="kvgraft-copy") as pool:
        results = list(pool.map(one, manifest.blobs()))
    moved = [n for _, n in results if n]
    return CopyStats(tuple(r for r, _ in results), len(moved), sum(moved))

"""Verify: re-read every blob an artifact needs from the store and check size and digest."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvgraft.blobstore.base import BlobStore
from kvgraft.catalog.records import BlobRecord
from kvgraft.codecs.codec import max_stored_size
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, NotFound
from kvgraft.formats.manifest import BlobRef, Manifest
from kvgraft.transfer.pull import transfer_workers, verify_stored


@dataclass(frozen=True, slots=True)
class BadBlob:
    digest: Digest
    reason: str


@dataclass(frozen=True, slots=True)
class VerifyReport:
    artifact: Digest
    checked: int
    checked_bytes: int
    bad: tuple[BadBlob, ...]
    problems: tuple[str, ...] = ()  # about the artifact itself (its manifest), not a blob

    @property
    def ok(self) -> bool:
        return not self.bad and not self.problems


def _check(store: BlobStore, ref: BlobRef, record: BlobRecord | None) -> BadBlob | None:
    try:
        stored = store.get(ref.digest, max_stored_size(ref.size))
    except NotFound:
        return BadBlob(ref.digest, f"missing from {store.url}")
    except IntegrityError as e:  # too large, or not a plain object
        return BadBlob(ref.digest, e.message)
    try:
        verify_stored(ref, stored, store.url)
    except IntegrityError as e:
        return BadBlob(ref.digest, e.message)
    if record is None:
        return BadBlob(ref.digest, "no blob row in the catalog")
    if record.stored_size != len(stored):
        return BadBlob(ref.digest, f"catalog says {record.stored_size} stored bytes, "
                                   f"the store holds {len(stored)}")
    return None


def verify_artifact(manifest: Manifest, store: BlobStore,
                    records: Mapping[Digest, BlobRecord], *, workers: int | None = None,
                    ) -> VerifyReport:
    refs = manifest.blobs()
    with ThreadPoolExecutor(workers or transfer_workers(),
                            thread_name_prefix="kvgraft-verify") as pool:
        results = list(pool.map(lambda r: _check(store, r, records.get(r.digest)), refs))
    bad = tuple(b for b in results if b is not None)
    return VerifyReport(manifest.digest, len(refs), sum(r.size for r in refs), bad)

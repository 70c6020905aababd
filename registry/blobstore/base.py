"""The BlobStore protocol every backend implements, and the shared key layout."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Protocol, runtime_checkable

from kvgraft.digest import Buffer, Digest


def blob_path(digest: Digest) -> str:
    """`sha256/ab/cdef…`: the fan-out keeps directories and S3 prefixes small."""
    return f"sha256/{digest.hex[:2]}/{digest.hex[2:]}"


@dataclass(frozen=True, slots=True)
class BlobInfo:
    digest: Digest
    stored_size: int
    mtime: float  # seconds since the epoch; gc's grace period is measured against it


@runtime_checkable
class BlobStore(Protocol):
    """Puts are idempotent and atomic: a reader never sees a partial blob."""

    @property
    def url(self) -> str: ...

    def exists(self, digest: Digest) -> bool: ...

    def stat(self, digest: Digest) -> BlobInfo | None: ...

    def put(self, digest: Digest, parts: Sequence[Buffer]) -> bool:
        """Store the concatenation of `parts` under `digest` unless present.

        Returns True if this call stored it, False if it was already there (first wins).
        """
        ...

    def replace(self, digest: Digest, parts: Sequence[Buffer]) -> None:
        """Atomically overwrite the blob under `digest` with `parts` (repair). Only for a
        caller that found the stored blob corrupt or missing and holds bytes that decode
        to `digest`: readers see the old or the new blob, never a mix."""
        ...

    def get(self, digest: Digest, max_size: int | None = None) -> bytes:
        """The whole stored blob (blobs are chunk-sized); NotFound if absent.

        With `max_size` (what the blob may take, from its manifest size), a stored object
        larger than that is refused with IntegrityError before it is read."""
        ...

    def open(self, digest: Digest) -> BinaryIO:
        """A streaming reader over the stored blob; NotFound if absent; IntegrityError
        if what the store holds is not a plain object (a device, a FIFO)."""
        ...

    def delete(self, digest: Digest) -> bool: ...

    def iter(self) -> Iterator[BlobInfo]: ...


@runtime_checkable
class Presigning(Protocol):
    """A store that can hand out a URL from which a client fetches a stored blob directly
    (S3), so a server need not pass the bytes through."""

    def presign(self, digest: Digest, expires: int) -> str:
        """A URL that GETs the stored blob (its stored bytes, Range honoured) for `expires`
        seconds, with no other credential."""
        ...


def too_large(digest: Digest, where: str, size: int, max_size: int) -> Exception:
    from kvgraft.errors import IntegrityError

    return IntegrityError(f"blob {digest} in {where} is corrupt: {size} stored bytes, "
                          f"at most {max_size} expected",
                          hint="repair: `kvgraft verify REF --repair`, or push the file again")

"""Committing a graft whose blobs a repository holds, whichever door it came through (a
kvgraft push commit under /kvgraft/v1/, an OCI manifest PUT under /v2/): the same checks
on its lineage, the one catalog write of a push, its event under the token's name."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from starlette.requests import Request

from kvgraft.blobstore import BlobStore
from kvgraft.catalog.records import BlobRecord, PushRecord
from kvgraft.codecs.codec import max_stored_size
from kvgraft.codecs.stream import decoded_pieces, reader_at, seekable, stored_header
from kvgraft.digest import Digest
from kvgraft.errors import Conflict, IntegrityError, NotFound
from kvgraft.formats.manifest import Manifest
from kvgraft.server.context import Context
from kvgraft.server.endpoint import visible_in


@dataclass(frozen=True, slots=True)
class Committed:
    created: bool  # whether the repository did not hold the artifact before
    previous: Digest | None  # what the tag pointed at before, if anything
    evicted: tuple[Digest, ...] = ()  # what the repository's quota evicted to make room


def check_stream(f: BinaryIO, digest: Digest, size: int) -> None:
    """Decode the stored blob in `f` piece by piece and hash it: memory stays a few pieces
    whatever size the client declared."""
    h = hashlib.sha256()
    for piece in decoded_pieces(seekable(f, max_stored_size(size)), size):
        h.update(piece)
    digest.check(Digest.from_hasher(h), "decoded content")


def checked_record(store: BlobStore, digest: Digest, size: int) -> BlobRecord | None:
    """The stored blob's row if it decodes to `size` bytes hashing to `digest`; None if it
    is corrupt (NotFound if it is gone)."""
    try:
        with store.open(digest) as raw, seekable(raw, max_stored_size(size)) as f:
            codec = stored_header(reader_at(f))[0]
            check_stream(f, digest, size)
            stored_size = f.seek(0, 2)
    except IntegrityError:
        return None
    return BlobRecord(digest, size, stored_size, codec)


def check_parents(request: Request, ctx: Context, manifest: Manifest) -> None:
    """A graft is committed only with its lineage, each parent one the caller may pull."""
    for parent in manifest.parents:
        visible_in(request, ctx, parent)


def commit(request: Request, ctx: Context, manifest: Manifest,
           records: tuple[BlobRecord, ...], repository: str, tag: str | None,
           labels: Mapping[str, str], action: str, detail: Mapping[str, Any]) -> Committed:
    """Record the push of `manifest` into `repository` (its blobs checked by the caller,
    `records` their rows from the store), then make sure no concurrent gc took a blob."""
    from kvgraft.transfer.gc import ensure_blobs

    event = ctx.event_record(request, action, repository=repository, tag=tag,
                             digest=manifest.digest, detail=dict(detail))
    catalog = ctx.catalog
    new_here = not _in_repository(ctx, repository, manifest.digest)
    outcome = catalog.record_push(PushRecord(manifest, records, repository, tag,
                                             dict(labels), event))

    def lost() -> list[BlobRecord]:
        raise Conflict(f"a gc deleted blobs of {manifest.digest} while it was pushed",
                       hint="push again")

    ensure_blobs(catalog, ctx.store, manifest, lost)
    # `created` as this repository sees it: whether another tenant pushed the same
    # content first is not this caller's to learn.
    return Committed(new_here, outcome.previous, outcome.evicted)


def _in_repository(ctx: Context, repository: str, digest: Digest) -> bool:
    try:
        return repository in ctx.catalog.artifact(digest).repositories
    except NotFound:
        return False

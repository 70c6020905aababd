"""The write side of an HTTP remote under /kvgraft/v1/: uploads, push commits, tags,
events and attestations (see catalogapi)."""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvgraft.blobstore import BlobStore
from kvgraft.catalog.records import AttestationRecord, BlobRecord
from kvgraft.client import check_labels
from kvgraft.codecs.codec import max_stored_size, parse_frame
from kvgraft.codecs.stream import reader_at, stored_header
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, RegistryError, UsageError
from kvgraft.formats.manifest import BlobRef, Manifest
from kvgraft.remote import wire
from kvgraft.server.context import Context
from kvgraft.server.endpoint import (
    RESERVED,
    digest_param,
    event_fields,
    principal_of,
    repository_param,
    require,
    require_admin,
    short_text,
    tag_param,
    visible_in,
)
from kvgraft.server.errors import OciError, digits
from kvgraft.server.graftcommit import check_parents, check_stream, checked_record, commit
from kvgraft.server.oci import _receive as receive

# --- writes --------------------------------------------------------------------------


def _upload_args(request: Request, ctx: Context) -> tuple[str, Digest, int]:
    repository = repository_param(request.query_params.get("repository"))
    require(request, ctx, repository, "push")
    size = request.query_params.get("size", "")
    if not digits(size, 4000):
        raise OciError(400, "SIZE_INVALID", "give the decoded size as ?size=N")
    if len(size) > 20 or int(size) > ctx.settings.max_upload_bytes:
        # Before any byte of the body is read: the decoded size is what verifying costs.
        raise OciError(413, "SIZE_INVALID", f"blob of {size[:24]} decoded bytes exceeds the "
                       f"upload limit of {ctx.settings.max_upload_bytes} bytes")
    return repository, digest_param(request.path_params["digest"]), int(size)


async def upload(request: Request) -> Response:
    """Store one blob as the client encoded it, once it decoded and hashed to its digest.
    The body is spooled to a scratch file, counted with the open uploads, so their limit
    bounds how many are taken in at once."""
    ctx: Context = request.app.state.ctx
    try:
        try:
            repository, digest, size = await run_in_threadpool(_upload_args, request, ctx)
        except OciError:
            # Read what was sent before refusing: a client still writing its body would
            # otherwise see the connection reset instead of the refusal.
            await _drain(request, ctx.settings.max_upload_bytes)
            raise
        limit = max_stored_size(size)  # the size itself is within --max-upload
        scratch = ctx.uploads.scratch(request.state.principal.name)
        try:
            fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                await receive(request, fd, 0, limit)
            finally:
                os.close(fd)
            answer = await run_in_threadpool(_store_upload, ctx, repository, digest, size,
                                             scratch)
        finally:
            scratch.unlink(missing_ok=True)
    except OciError as e:
        return e.response()
    except RegistryError as e:
        return ctx.registry_error(request, e).response()
    return JSONResponse(answer)


async def _drain(request: Request, limit: int) -> None:
    seen = 0
    with contextlib.suppress(ClientDisconnect):
        async for piece in request.stream():
            seen += len(piece)
            if seen > limit:
                return


def _store_upload(ctx: Context, repository: str, digest: Digest, size: int,
                  path: Path) -> dict[str, Any]:
    """The first good copy wins; one that no longer verifies is replaced (so pushing a
    file again repairs it). The repository then holds the blob.

    The answer describes this upload as this repository sees it: `stored` is whether the
    repository did not hold the blob before, and the size and codec are those of the bytes
    sent. Whether another repository's copy was already in the store is not said: that
    would tell a tenant which content others hold (docs/security.md)."""
    try:
        with open(path, "rb") as f:
            check_stream(f, digest, size)
            codec = stored_header(reader_at(f))[0]
    except IntegrityError as e:
        raise OciError(400, "DIGEST_INVALID", f"the upload of blob {digest} is corrupt: "
                       f"{e.message}") from None
    new_here = ctx.oci.blob_size(repository, str(digest)) is None
    store = ctx.store
    present = store.stat(digest) is not None
    kept = checked_record(store, digest, size) if present else None
    if kept is None:
        _put_file(store, digest, path, replace=present)
        kept = checked_record(store, digest, size)
        if kept is None:
            raise OciError(503, "UNAVAILABLE", f"blob {digest} did not read back intact")
    ctx.catalog.refresh_blobs([kept])
    ctx.oci.link_blob(repository, str(digest), size)
    return {"digest": str(digest), "stored": new_here, "stored_size": path.stat().st_size,
            "codec": codec}


def _put_file(store: BlobStore, digest: Digest, path: Path, *, replace: bool) -> bool:
    """Store the (verified, so never empty) file at `path` as blob `digest`, mapped rather
    than read into memory."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            if replace:
                store.replace(digest, [view])
                return True
            return store.put(digest, [view])
        finally:
            view.release()


def _held(ctx: Context, repository: str, ref: BlobRef) -> BlobRecord | None:
    """The blob's row if `repository` holds it and the store has it, its frame naming the
    manifest's size."""
    if ctx.oci.blob_size(repository, str(ref.digest)) is None:
        return None
    store = ctx.store
    info = store.stat(ref.digest)
    if info is None:
        return None
    with store.open(ref.digest) as f:
        head = f.read(272)
    try:
        codec, size, _ = parse_frame(head)
    except IntegrityError:
        return None
    if size != ref.size:
        raise OciError(400, "MANIFEST_INVALID", f"the manifest gives blob {ref.digest} "
                       f"{ref.size} bytes; it holds {size}")
    return BlobRecord(ref.digest, ref.size, info.stored_size, codec)


def _pushed_manifest(request: Request, ctx: Context, body: Any,
                     ) -> tuple[str, str | None, dict[str, str], Manifest]:
    """The repository, tag, labels and parsed manifest of a push commit, once the caller
    may push there."""
    if not isinstance(body, dict) or not isinstance(body.get("manifest"), str):
        raise OciError(400, "MANIFEST_INVALID", "give the manifest's canonical JSON")
    repository = repository_param(body.get("repository"))
    require(request, ctx, repository, "push")
    tag = tag_param(body["tag"]) if body.get("tag") is not None else None
    try:
        labels = check_labels({str(k): str(v) for k, v in (body.get("labels") or {}).items()})
        raw = body["manifest"].encode()
        if len(raw) > ctx.settings.max_manifest_bytes:
            raise OciError(413, "SIZE_INVALID", f"the manifest is larger than "
                           f"{ctx.settings.max_manifest_bytes} bytes")
        manifest = Manifest.parse(raw, Digest.of(raw))
    except (IntegrityError, AttributeError) as e:
        why = e.human() if isinstance(e, IntegrityError) else str(e)
        raise OciError(400, "MANIFEST_INVALID", why) from None
    return repository, tag, labels, manifest


def _held_blobs(ctx: Context, repository: str, manifest: Manifest) -> tuple[BlobRecord, ...]:
    """The rows of every blob the manifest names, from what the repository holds."""
    records, missing = [], []
    for ref in manifest.blobs():
        held = _held(ctx, repository, ref)
        if held is None:
            missing.append(str(ref.digest))
        else:
            records.append(held)
    if missing:
        raise OciError(400, "MANIFEST_BLOB_UNKNOWN",
                       f"{repository} does not hold {len(missing)} of the blobs the manifest "
                       f"names (first {missing[0]}): upload them first",
                       detail={"missing": missing[:100]})
    return tuple(records)


def push(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    """Commit a push: the manifest must parse and hash to its digest, and the repository
    must hold every blob it names; the rows come from the store, not the client."""
    repository, tag, labels, manifest = _pushed_manifest(request, ctx, body)
    check_parents(request, ctx, manifest)
    records = _held_blobs(ctx, repository, manifest)
    action, _, detail = event_fields(body)
    done = commit(request, ctx, manifest, records, repository, tag, labels,
                  "copy" if action == "copy" else "push", detail)
    return {"digest": str(manifest.digest), "created": done.created,
            "previous": str(done.previous) if done.previous else None,
            "evicted": [str(d) for d in done.evicted]}


def tag(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OciError(400, "UNSUPPORTED", "give repository, tag and digest")
    repository = repository_param(body.get("repository"))
    require(request, ctx, repository, "push")
    name = tag_param(body.get("tag"))
    digest = digest_param(str(body.get("digest")))
    visible_in(request, ctx, digest)  # only what the caller may read can be tagged
    _, _, detail = event_fields(body)
    previous = ctx.catalog.set_tag(repository, name, digest, ctx.event_record(
        request, "tag", repository=repository, tag=name, digest=digest, detail=detail))
    return {"previous": str(previous) if previous else None}


def untag(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OciError(400, "UNSUPPORTED", "give repository and tag")
    repository = repository_param(body.get("repository"))
    require(request, ctx, repository, "delete")
    name = tag_param(body.get("tag"))
    digest = ctx.catalog.remove_tag(repository, name, ctx.event_record(
        request, "untag", repository=repository, tag=name))
    return {"digest": str(digest)}


def add_event(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    """An event a command records about what it did (pull, verify, a refused load…)."""
    if not isinstance(body, dict):
        raise OciError(400, "UNSUPPORTED", "give the event")
    action, outcome, detail = event_fields(body)
    if not action or action in RESERVED:
        raise OciError(400, "UNSUPPORTED", f"{action or 'an empty action'!r} is not an "
                       "event a client records itself")
    if "statement_digest" in detail:  # an attestation's anchor: written with it, only
        raise OciError(400, "UNSUPPORTED", "statement_digest is recorded with an "
                       "attestation (POST /attestations), not as a plain event")
    if principal_of(request, ctx).token is None:  # the log is append-only: no anonymous
        raise ctx.refuse(request, request.state.principal, None, "push")
    repository = body.get("repository")
    digest = digest_param(str(body["digest"])) if body.get("digest") else None
    tag_name = tag_param(body["tag"]) if body.get("tag") is not None else None
    if repository is not None:
        require(request, ctx, repository_param(repository), "pull")
    if digest is not None:
        visible = visible_in(request, ctx, digest)
        if repository is not None and repository not in visible:
            raise OciError(404, "NAME_UNKNOWN", f"artifact {digest} is not in {repository}")
        # Recorded in a repository of the caller's that holds the artifact: an event in
        # no repository is shown to admins only (its actor is the caller's business).
        repository = repository if repository is not None else visible[0]
    if repository is None and digest is None:
        require_admin(request, ctx)
    ctx.event(request, action, outcome=outcome, repository=repository, tag=tag_name,
              digest=digest, detail=detail)
    return {}


def add_attestation(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    """Store a statement (signed or not) about an artifact the caller may push to."""
    from kvgraft.provenance import Statement

    att = body.get("attestation") if isinstance(body, dict) else None
    if not isinstance(att, dict):
        raise OciError(400, "UNSUPPORTED", "give the attestation")
    try:
        record_in = wire.attestation_record(att)
        statement = Statement.parse(record_in.statement)
    except IntegrityError as e:
        raise OciError(400, "MANIFEST_INVALID", f"invalid statement: {e.human()}") from None
    except (KeyError, TypeError, ValueError, AttributeError, UsageError) as e:
        raise OciError(400, "UNSUPPORTED", f"malformed attestation: {e}") from None
    short_text(record_in.predicate_type, "the predicate type")
    if record_in.keyid is not None:
        short_text(record_in.keyid, "the key id")
    digest = record_in.artifact
    if all(s.digest != digest for s in statement.subjects):
        raise OciError(400, "MANIFEST_INVALID", f"the statement is not about {digest}")
    visible = visible_in(request, ctx, digest, "push")
    action, _, detail = event_fields(body)
    event_repo = body.get("event", {}).get("repository") if isinstance(
        body.get("event"), dict) else None
    stored = AttestationRecord(digest, record_in.predicate_type, record_in.statement,
                               record_in.envelope, record_in.keyid)
    # The anchor is the stored statement's digest, whatever the client said it was.
    event = ctx.event_record(request, "sign" if action == "sign" else "attest",
                             repository=event_repo if event_repo in visible else visible[0],
                             digest=digest, detail={
                                 **detail, "statement_digest": str(stored.statement_digest)})
    return {"id": ctx.catalog.add_attestation(stored, event)}

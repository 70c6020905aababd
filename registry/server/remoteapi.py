"""What an HTTP remote needs beyond pulling, under /kvgraft/v1/: the catalog methods a
Registry calls (kvgraft.httpcatalog) and blob uploads (kvgraft.httpremote.HttpStore).

Every request is authorised per repository and action: pull to read, push to upload,
commit and tag, delete to untag, admin for the whole event log. An artifact the token may
not pull in any repository holding it does not exist for it (404, not 403). Events are
written here, under the token's name and the caller's address, whatever the client says;
blob rows are derived from the store, never taken from the client; an upload becomes
visible only once it decoded and hashed to its digest."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvgraft import wire
from kvgraft.catalog.models import (
    ArtifactBlobRow,
    ArtifactRow,
    BlobRow,
    RepositoryArtifactRow,
)
from kvgraft.catalog.records import AttestationRecord, BlobRecord, PushRecord
from kvgraft.client import check_labels
from kvgraft.codec import max_stored_size, parse_frame
from kvgraft.digest import Digest
from kvgraft.errors import Conflict, IntegrityError, NotFound, RegistryError, UsageError
from kvgraft.manifest import BlobRef, Manifest
from kvgraft.reference import Reference, check_name
from kvgraft.server.auth import Principal
from kvgraft.server.context import Context
from kvgraft.server.errors import OciError
from kvgraft.server.kvapi import PREFIX
from kvgraft.server.oci import _receive as receive

MAX_JSON = 16 << 20  # a push body: the manifest and its labels
MAX_DETAIL = 64 << 10  # the JSON of one event's detail
MAX_DIGESTS = 100_000
# Events with their own endpoint (and checks): a client cannot log them as plain events.
# ("copy" can be: the source side of a copy logs one about an artifact already there, and
# only an artifact's first push or copy is its origin.)
RESERVED = frozenset({"push", "tag", "untag", "sign", "attest", "gc", "repair",
                      "token-create", "token-revoke"})

Handler = Callable[[Request, Context, Any], Any]


def _principal(request: Request, ctx: Context) -> Principal:
    principal = ctx.authenticate(request)
    request.state.principal = principal
    return principal


def _require(request: Request, ctx: Context, repository: str, action: str) -> Principal:
    principal = _principal(request, ctx)
    if not principal.may(ctx.settings, repository, action):
        raise ctx.refuse(request, principal, repository, action)
    return principal


def _digest(text: str) -> Digest:
    try:
        return Digest.parse(text)
    except UsageError as e:
        raise OciError(400, "DIGEST_INVALID", e.human()) from None


def _repository(text: Any) -> str:
    if not isinstance(text, str):
        raise OciError(400, "NAME_INVALID", "give the repository")
    try:
        check_name(text)
    except UsageError as e:
        raise OciError(400, "NAME_INVALID", e.human()) from None
    return text


def _visible(request: Request, ctx: Context, digest: Digest,
             action: str = "pull") -> tuple[str, ...]:
    """The repositories holding `digest` in which the caller may `action`; an artifact it
    may not even pull is not found."""
    principal = _principal(request, ctx)
    try:
        repos = ctx.registry.catalog.artifact(digest).repositories
    except NotFound:
        repos = ()
    readable = tuple(r for r in repos if principal.may(ctx.settings, r, "pull"))
    if not readable:
        raise OciError(404, "NAME_UNKNOWN", f"artifact {digest} is not in the catalog")
    allowed = tuple(r for r in readable if principal.may(ctx.settings, r, action))
    if not allowed:
        raise ctx.refuse(request, principal, readable[0], action)
    return allowed


def _event_fields(body: Any) -> tuple[str, str, dict[str, Any]]:
    """(action, outcome, detail) of a client's event description, bounded."""
    about = body.get("event") if isinstance(body, dict) and "event" in body else body
    if not isinstance(about, dict):
        return "", "ok", {}
    detail = about.get("detail") or {}
    if not isinstance(detail, dict) or len(json.dumps(detail)) > MAX_DETAIL:
        raise OciError(400, "UNSUPPORTED", f"an event's detail is a JSON object of at most "
                       f"{MAX_DETAIL} bytes")
    action = about.get("action") or ""
    outcome = about.get("outcome") or "ok"
    if not isinstance(action, str) or not isinstance(outcome, str) or \
            len(action) > 64 or len(outcome) > 64:
        raise OciError(400, "UNSUPPORTED", "an event's action and outcome are short strings")
    return action, outcome, detail


def _endpoint(fn: Handler, *, body: str | None = None) -> Callable[[Request], Awaitable[Response]]:
    """`body`: "json" reads a bounded JSON body; the handler runs on a worker thread."""

    async def endpoint(request: Request) -> Response:
        ctx: Context = request.app.state.ctx
        try:
            payload: Any = None
            if body == "json":
                payload = _json(await _read(request, MAX_JSON))
            answer = await run_in_threadpool(fn, request, ctx, payload)
        except OciError as e:
            return e.response()
        except RegistryError as e:
            return ctx.registry_error(request, e).response()
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    return endpoint


async def _read(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise OciError(413, "SIZE_INVALID", f"the body may hold at most {limit} bytes")
    data = bytearray()
    try:
        async for piece in request.stream():
            data += piece
            if len(data) > limit:
                raise OciError(413, "SIZE_INVALID",
                               f"the body may hold at most {limit} bytes")
    except ClientDisconnect:  # nothing was stored; the client sends it again
        raise OciError(400, "BLOB_UPLOAD_INVALID", "the connection closed mid-body") from None
    if declared is not None and len(data) != int(declared):
        raise OciError(400, "BLOB_UPLOAD_INVALID", f"the body is truncated: {len(data)} of "
                       f"{declared} bytes")
    return bytes(data)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:
        raise OciError(400, "UNSUPPORTED", f"the body is not JSON: {e}") from None


# --- reads ---------------------------------------------------------------------------


def record(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    digest = _digest(request.path_params["digest"])
    visible = _visible(request, ctx, digest)
    r = ctx.registry.catalog.artifact(digest)
    out = wire.artifact_json(r)
    out["repositories"] = list(visible)
    out["tags"] = [wire.tag_json(t) for t in r.tags if t.repository in visible]
    return {"artifact": out}


def tags(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    principal = _principal(request, ctx)
    pattern = request.query_params.get("pattern") or None
    if pattern is not None and len(pattern) > 512:
        raise OciError(400, "NAME_INVALID", "the pattern is longer than 512 characters")
    problems: list[str] = []
    found = ctx.registry.catalog.list_tags(pattern, problems=problems)
    if pattern:
        found = tuple(t for t in found if fnmatch.fnmatchcase(t.repository, pattern))
    admin = principal.may(ctx.settings, "*", "admin")
    return {"tags": [wire.tag_json(t) for t in found
                     if principal.may(ctx.settings, t.repository, "pull")],
            "problems": problems if admin else []}


def blob_records(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    principal = _principal(request, ctx)
    wanted = body.get("digests") if isinstance(body, dict) else None
    if not isinstance(wanted, list) or len(wanted) > MAX_DIGESTS:
        raise OciError(400, "UNSUPPORTED", f"give at most {MAX_DIGESTS} digests")
    keys = [str(_digest(str(d))) for d in wanted]
    out: dict[str, BlobRecord] = {}
    with ctx.registry.catalog._session() as s:  # rows of blobs in readable repositories
        for i in range(0, len(keys), 500):
            rows = s.execute(
                select(BlobRow, RepositoryArtifactRow.repository)
                .join(ArtifactBlobRow, ArtifactBlobRow.blob_digest == BlobRow.digest)
                .join(RepositoryArtifactRow, RepositoryArtifactRow.artifact_digest
                      == ArtifactBlobRow.artifact_digest)
                .where(BlobRow.digest.in_(keys[i:i + 500])))
            for b, repository in rows:
                if b.digest not in out and principal.may(ctx.settings, repository, "pull"):
                    out[b.digest] = BlobRecord(Digest.parse(b.digest), b.size,
                                               b.stored_size, b.codec)
    return {"blobs": [wire.blob_json(b) for b in out.values()]}


def artifact_digests(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    principal = _principal(request, ctx)
    seen: dict[str, None] = {}
    with ctx.registry.catalog._session() as s:
        rows = s.execute(select(ArtifactRow.digest, RepositoryArtifactRow.repository)
                         .join(RepositoryArtifactRow, RepositoryArtifactRow.artifact_digest
                               == ArtifactRow.digest)
                         .order_by(ArtifactRow.created_at, ArtifactRow.digest))
        for digest, repository in rows:
            if principal.may(ctx.settings, repository, "pull"):
                seen.setdefault(digest)
    return {"digests": list(seen)}


def events(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    q = request.query_params
    digest = _digest(q["digest"]) if q.get("digest") else None
    if digest is not None:
        _visible(request, ctx, digest)
    else:  # the whole log names every repository: admin only
        _require(request, ctx, "*", "admin")
    principal: Principal = request.state.principal
    try:
        since = datetime.fromisoformat(q["since"]) if q.get("since") else None
        limit = int(q["limit"]) if q.get("limit") else None
    except ValueError as e:
        raise OciError(400, "UNSUPPORTED", f"bad since/limit: {e}") from None
    found = ctx.registry.catalog.events(digest=digest, action=q.get("action") or None,
                                        since=since, limit=limit)
    return {"events": [wire.event_json(e) for e in found
                       if e.repository is None
                       or principal.may(ctx.settings, e.repository, "pull")]}


def attestations(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    digest = _digest(request.path_params["digest"])
    _visible(request, ctx, digest)
    catalog = ctx.registry.catalog
    found = catalog.attestations(digest, request.query_params.get("predicate_type") or None)
    return {"attestations": [wire.attestation_json(a) for a in found],
            "recorded": {str(k): v for k, v in catalog.attestation_digests(digest).items()}}


def children(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    digest = _digest(request.path_params["digest"])
    _visible(request, ctx, digest)
    principal: Principal = request.state.principal
    out = []
    for child in ctx.registry.catalog.children(digest):
        repos = ctx.registry.catalog.artifact(child).repositories
        if any(principal.may(ctx.settings, r, "pull") for r in repos):
            out.append(str(child))
    return {"children": out}


def event_chain(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    """Whether the event log's hash chain holds: counts and problems, no event contents,
    so any token may ask (an audit checks it)."""
    if _principal(request, ctx).token is None:
        raise ctx.refuse(request, request.state.principal, None, "pull")
    catalog = ctx.registry.catalog
    return {"chain": catalog.event_chain().to_json(),
            "trigger_problems": catalog.event_trigger_problems()}


def blob_info(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    """A blob this repository holds (or was sent), for a caller that may pull or push
    there: what a push asks before uploading."""
    repository = _repository(request.query_params.get("repository"))
    principal = _principal(request, ctx)
    if not (principal.may(ctx.settings, repository, "pull")
            or principal.may(ctx.settings, repository, "push")):
        raise ctx.refuse(request, principal, repository, "pull")
    digest = _digest(request.path_params["digest"])
    info = None
    if ctx.oci.blob_size(repository, str(digest)) is not None:
        info = ctx.registry.store.stat(digest)
    if info is None:
        raise OciError(404, "BLOB_UNKNOWN", f"blob {digest} is not in {repository}")
    return {"digest": str(digest), "stored_size": info.stored_size, "mtime": info.mtime}


# --- writes --------------------------------------------------------------------------


def _upload_args(request: Request, ctx: Context) -> tuple[str, Digest, int]:
    repository = _repository(request.query_params.get("repository"))
    _require(request, ctx, repository, "push")
    size = request.query_params.get("size", "")
    if not size.isdigit():
        raise OciError(400, "SIZE_INVALID", "give the decoded size as ?size=N")
    return repository, _digest(request.path_params["digest"]), int(size)


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
        limit = min(max_stored_size(size), ctx.settings.max_upload_bytes)
        scratch = ctx.uploads.scratch()
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
    file again repairs it). The repository then holds the blob."""
    from kvgraft.pull import verify_stored
    from kvgraft.push import checked_record

    # Blob-sized (the limit is the declared size's bound), and as many at once as the
    # open-upload limit lets in.
    data = path.read_bytes()
    try:
        verify_stored(BlobRef(digest, size), data, "the upload")
    except IntegrityError as e:
        raise OciError(400, "DIGEST_INVALID", e.human()) from None
    store = ctx.registry.store
    stored = False
    present = store.stat(digest) is not None
    kept = checked_record(store, digest, size) if present else None
    if kept is None:
        if present:
            store.replace(digest, [data])
            stored = True
        else:
            stored = store.put(digest, [data])
        kept = checked_record(store, digest, size)
        if kept is None:
            raise OciError(503, "UNAVAILABLE", f"blob {digest} did not read back intact")
    ctx.registry.catalog.refresh_blobs([kept])
    ctx.oci.link_blob(repository, str(digest), size)
    return {"digest": str(digest), "stored": stored, "stored_size": kept.stored_size,
            "codec": kept.codec}


def _held(ctx: Context, repository: str, ref: BlobRef) -> BlobRecord | None:
    """The blob's row if `repository` holds it and the store has it, its frame naming the
    manifest's size."""
    if ctx.oci.blob_size(repository, str(ref.digest)) is None:
        return None
    store = ctx.registry.store
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


def push(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    """Commit a push: the manifest must parse and hash to its digest, and the repository
    must hold every blob it names; the rows come from the store, not the client."""
    from kvgraft.gc import ensure_blobs

    if not isinstance(body, dict) or not isinstance(body.get("manifest"), str):
        raise OciError(400, "MANIFEST_INVALID", "give the manifest's canonical JSON")
    repository = _repository(body.get("repository"))
    _require(request, ctx, repository, "push")
    tag = body.get("tag")
    try:
        if tag is not None:
            Reference.parse(f"{repository}:{tag}")
        labels = check_labels({str(k): str(v) for k, v in (body.get("labels") or {}).items()})
        raw = body["manifest"].encode()
        if len(raw) > ctx.settings.max_manifest_bytes:
            raise OciError(413, "SIZE_INVALID", f"the manifest is larger than "
                           f"{ctx.settings.max_manifest_bytes} bytes")
        manifest = Manifest.parse(raw, Digest.of(raw))
    except (IntegrityError, AttributeError) as e:
        why = e.human() if isinstance(e, IntegrityError) else str(e)
        raise OciError(400, "MANIFEST_INVALID", why) from None
    for parent in manifest.parents:
        _visible(request, ctx, parent)
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
    action, _, detail = _event_fields(body)
    event = ctx.event_record(request, "copy" if action == "copy" else "push",
                             repository=repository, tag=tag, digest=manifest.digest,
                             detail=detail)
    catalog = ctx.registry.catalog
    outcome = catalog.record_push(PushRecord(manifest, tuple(records), repository, tag,
                                             labels, event))

    def lost() -> list[BlobRecord]:
        raise Conflict(f"a gc deleted blobs of {manifest.digest} while it was pushed",
                       hint="push again")

    ensure_blobs(catalog, ctx.registry.store, manifest, lost)
    return {"digest": str(manifest.digest), "created": outcome.created,
            "previous": str(outcome.previous) if outcome.previous else None}


def tag(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OciError(400, "UNSUPPORTED", "give repository, tag and digest")
    repository = _repository(body.get("repository"))
    _require(request, ctx, repository, "push")
    name = str(body.get("tag"))
    try:
        Reference.parse(f"{repository}:{name}")
    except UsageError as e:
        raise OciError(400, "NAME_INVALID", e.human()) from None
    digest = _digest(str(body.get("digest")))
    _visible(request, ctx, digest)  # only what the caller may read can be tagged
    _, _, detail = _event_fields(body)
    previous = ctx.registry.catalog.set_tag(repository, name, digest, ctx.event_record(
        request, "tag", repository=repository, tag=name, digest=digest, detail=detail))
    return {"previous": str(previous) if previous else None}


def untag(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OciError(400, "UNSUPPORTED", "give repository and tag")
    repository = _repository(body.get("repository"))
    _require(request, ctx, repository, "delete")
    name = str(body.get("tag"))
    digest = ctx.registry.catalog.remove_tag(repository, name, ctx.event_record(
        request, "untag", repository=repository, tag=name))
    return {"digest": str(digest)}


def add_event(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    """An event a command records about what it did (pull, verify, a refused load…)."""
    if not isinstance(body, dict):
        raise OciError(400, "UNSUPPORTED", "give the event")
    action, outcome, detail = _event_fields(body)
    if not action or action in RESERVED:
        raise OciError(400, "UNSUPPORTED", f"{action or 'an empty action'!r} is not an "
                       "event a client records itself")
    repository = body.get("repository")
    digest = _digest(str(body["digest"])) if body.get("digest") else None
    if repository is not None:
        _require(request, ctx, _repository(repository), "pull")
    if digest is not None:
        visible = _visible(request, ctx, digest)
        if repository is not None and repository not in visible:
            raise OciError(404, "NAME_UNKNOWN", f"artifact {digest} is not in {repository}")
    if repository is None and digest is None:
        _require(request, ctx, "*", "admin")
    tag_name = body.get("tag")
    ctx.event(request, action, outcome=outcome, repository=repository,
              tag=str(tag_name) if tag_name is not None else None, digest=digest,
              detail=detail)
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
    digest = record_in.artifact
    if all(s.digest != digest for s in statement.subjects):
        raise OciError(400, "MANIFEST_INVALID", f"the statement is not about {digest}")
    visible = _visible(request, ctx, digest, "push")
    action, _, detail = _event_fields(body)
    event_repo = body.get("event", {}).get("repository") if isinstance(
        body.get("event"), dict) else None
    stored = AttestationRecord(digest, record_in.predicate_type, record_in.statement,
                               record_in.envelope, record_in.keyid)
    event = ctx.event_record(request, "sign" if action == "sign" else "attest",
                             repository=event_repo if event_repo in visible else visible[0],
                             digest=digest, detail=detail)
    return {"id": ctx.registry.catalog.add_attestation(stored, event)}


def routes() -> list[Route]:
    p = PREFIX
    return [
        Route(f"{p}/record/{{digest}}", _endpoint(record), methods=["GET"]),
        Route(f"{p}/tags", _endpoint(tags), methods=["GET"]),
        Route(f"{p}/blob-records", _endpoint(blob_records, body="json"), methods=["POST"]),
        Route(f"{p}/artifact-digests", _endpoint(artifact_digests), methods=["GET"]),
        Route(f"{p}/events", _endpoint(events), methods=["GET"]),
        Route(f"{p}/events", _endpoint(add_event, body="json"), methods=["POST"]),
        Route(f"{p}/attestations/{{digest}}", _endpoint(attestations), methods=["GET"]),
        Route(f"{p}/attestations", _endpoint(add_attestation, body="json"), methods=["POST"]),
        Route(f"{p}/children/{{digest}}", _endpoint(children), methods=["GET"]),
        Route(f"{p}/event-chain", _endpoint(event_chain), methods=["GET"]),
        Route(f"{p}/blobinfo/{{digest}}", _endpoint(blob_info), methods=["GET"]),
        Route(f"{p}/upload/{{digest}}", upload, methods=["PUT"]),
        Route(f"{p}/push", _endpoint(push, body="json"), methods=["POST"]),
        Route(f"{p}/tag", _endpoint(tag, body="json"), methods=["POST"]),
        Route(f"{p}/untag", _endpoint(untag, body="json"), methods=["POST"]),
    ]

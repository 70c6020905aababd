"""What OCI has no word for, under /kvgraft/v1/: resolve, artifact details and labels,
model identities, the audit log, and prefix lookup. JSON in and out; errors in the OCI
error shape; the same tokens and scopes as /v2/."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import select
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvgraft.catalog.models import ModelRow
from kvgraft.errors import UsageError
from kvgraft.identity.model import ModelIdentity
from kvgraft.oci import graft as ocigraft
from kvgraft.reference import Reference
from kvgraft.server import content
from kvgraft.server.context import Context
from kvgraft.server.endpoint import endpoint_of, json_body, principal_of, require
from kvgraft.server.errors import OciError, digits

PREFIX = "/kvgraft/v1"
MAX_BODY = 16 << 20


def _ref(request: Request) -> Reference:
    text = request.query_params.get("ref")
    if not text:
        raise OciError(400, "UNSUPPORTED", "give the reference as ?ref=name[:tag|@digest]")
    try:
        return Reference.parse(text)
    except UsageError as e:
        raise OciError(400, "NAME_INVALID", e.human()) from None


def _guarded(fn: Callable[[Request, Context], Any]) -> Callable[[Request], Any]:
    return endpoint_of(lambda request, ctx, _: fn(request, ctx))


def resolve(request: Request, ctx: Context) -> dict[str, Any]:
    ref = _ref(request)
    require(request, ctx, ref.name, "pull")
    digest = ctx.catalog.resolve(ref)
    return {"reference": str(ref), "digest": str(digest),
            "oci_digest": ocigraft.oci_digest(ctx.render_graft(digest))}


def artifact(request: Request, ctx: Context) -> dict[str, Any]:
    ref = _ref(request)
    require(request, ctx, ref.name, "pull")
    digest = ctx.catalog.resolve(ref)
    record = ctx.catalog.artifact(digest)
    out = ctx.registry.inspect(Reference(ref.name, digest=digest)).to_json()
    # Only what this caller may see: other repositories holding the graft stay hidden.
    principal = request.state.principal
    visible = [r for r in record.repositories if principal.may(ctx.settings, r, "pull")]
    out["repositories"] = visible
    out["tags"] = [f"{t.repository}:{t.tag}" for t in record.tags if t.repository in visible]
    return out


def labels(request: Request, ctx: Context) -> dict[str, Any]:
    ref = _ref(request)
    require(request, ctx, ref.name, "pull")
    record = ctx.catalog.artifact(ctx.catalog.resolve(ref))
    return {"digest": str(record.digest), "labels": dict(record.labels)}


def models(request: Request, ctx: Context) -> dict[str, Any]:
    principal_of(request, ctx)
    if request.state.principal.token is None:
        raise ctx.refuse(request, request.state.principal, None, "pull")
    with ctx.catalog._session() as s:
        rows = s.scalars(select(ModelRow).order_by(ModelRow.id)).all()
        return {"models": [{"identity": r.identity, "name": r.name,
                            "architecture": r.architecture, "tokenizer": r.tokenizer,
                            "weights": r.weights} for r in rows]}


def log(request: Request, ctx: Context) -> dict[str, Any]:
    text = request.query_params.get("ref")
    if text:
        ref = _ref(request)
        require(request, ctx, ref.name, "pull")
        events = ctx.registry.log(ref)
    else:  # the whole log names every repository: admin only
        require(request, ctx, "*", "admin")
        events = ctx.registry.log(None)
    return {"events": [{"id": e.id, "at": e.at.isoformat() if e.at else None,
                        "action": e.action, "actor": e.actor, "host": e.host,
                        "outcome": e.outcome, "repository": e.repository, "tag": e.tag,
                        "digest": str(e.digest) if e.digest else None,
                        "detail": dict(e.detail)} for e in events]}


def match(request: Request, ctx: Context) -> dict[str, Any]:
    from kvgraft.services.match import match as prefix_match

    principal = principal_of(request, ctx)
    raw = request.query_params.get("q")
    if raw is None or len(raw) > MAX_BODY:
        raise OciError(400, "UNSUPPORTED",
                       'give ?q={"model": {architecture, tokenizer, weights}, "tokens": [...]}')
    query = json_body(raw.encode("utf-8", "replace"))
    model, tokens = (query.get("model"), query.get("tokens")) if isinstance(query, dict) \
        else (None, None)
    if not isinstance(model, dict) or not isinstance(tokens, list) or not all(
            type(t) is int for t in tokens):
        raise OciError(400, "UNSUPPORTED", "a match query is {\"model\": {...}, "
                       "\"tokens\": [integers]}")
    try:
        identity = ModelIdentity.from_json(model)
    except (ValueError, KeyError, TypeError, AttributeError, UsageError) as e:
        raise OciError(400, "UNSUPPORTED", f"malformed match query: {e}") from None
    found = prefix_match(ctx.registry, identity, tokens)
    if found is None:
        return {"match": None}
    repos = ctx.catalog.artifact(found.digest).repositories
    if not any(principal.may(ctx.settings, r, "pull") for r in repos):
        return {"match": None}  # what the caller may not pull does not exist for them
    return {"match": found.to_json()}


def stored(request: Request, ctx: Context) -> Response:
    """A graft blob exactly as stored (encoded, self-describing): what an HTTP remote's pull
    fetches into its machine cache and verifies there. `Range: bytes=N-` resumes. With
    `--redirect-blobs` and a store that presigns, a 307 to the store instead."""
    from starlette.responses import StreamingResponse

    from kvgraft.digest import Digest

    repository = request.query_params.get("repository", "")
    require(request, ctx, repository, "pull")
    try:
        digest = Digest.parse(request.path_params["digest"])
    except UsageError as e:
        raise OciError(400, "DIGEST_INVALID", e.human()) from None
    if ctx.oci.blob_size(repository, str(digest)) is None:
        raise OciError(404, "BLOB_UNKNOWN", f"blob {digest} is not in {repository}")
    if ctx.settings.redirect_blobs:
        # Only after the scope check: the URL is a credential for the blob. Not stat'ed
        # first (one round trip to the store saved per blob): a missing object is the
        # client's 404 from the store, which it reports as lost data like any other.
        url = content.presigned(ctx.store, digest, ctx.settings.redirect_seconds)
        if url is not None:
            return Response(status_code=307, headers={"Location": url,
                                                      "Cache-Control": "no-store"})
    info = ctx.store.stat(digest)
    if info is None:
        raise OciError(404, "BLOB_UNKNOWN", f"blob {digest} is missing from the store")
    start = 0
    rng = request.headers.get("range", "")
    if rng.startswith("bytes=") and rng.endswith("-") and digits(rng[6:-1]):
        start = int(rng[6:-1])
        if start >= info.stored_size:
            return Response(status_code=416,
                            headers={"Content-Range": f"bytes */{info.stored_size}"})
    f = ctx.store.open(digest)

    def pieces() -> Iterator[bytes]:
        with f:
            skip = start
            while skip:
                skip -= len(f.read(min(skip, 1 << 20))) or skip
            while piece := f.read(1 << 20):
                yield piece

    headers = {"Content-Length": str(info.stored_size - start), "Accept-Ranges": "bytes"}
    if start:
        headers["Content-Range"] = f"bytes {start}-{info.stored_size - 1}/{info.stored_size}"
    return StreamingResponse(pieces(), status_code=206 if start else 200, headers=headers,
                             media_type="application/vnd.kvgraft.stored-blob")


def routes() -> list[Route]:
    return [
        Route(f"{PREFIX}/resolve", _guarded(resolve), methods=["GET"]),
        Route(f"{PREFIX}/artifact", _guarded(artifact), methods=["GET"]),
        Route(f"{PREFIX}/labels", _guarded(labels), methods=["GET"]),
        Route(f"{PREFIX}/models", _guarded(models), methods=["GET"]),
        Route(f"{PREFIX}/log", _guarded(log), methods=["GET"]),
        Route(f"{PREFIX}/match", _guarded(match), methods=["GET"]),
        Route(f"{PREFIX}/stored/{{digest}}", _guarded(stored), methods=["GET"]),
    ]

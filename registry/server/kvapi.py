"""What OCI has no word for, under /kvgraft/v1/: resolve, artifact details and labels,
model identities, the audit log, and prefix lookup. JSON in and out; errors in the OCI
error shape; the same tokens and scopes as /v2/."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvgraft.catalog.models import ArtifactRow, ModelRow, RepositoryArtifactRow
from kvgraft.catalog.records import EventRecord
from kvgraft.digest import Digest
from kvgraft.errors import NotFound, UsageError
from kvgraft.identity.model import ModelIdentity
from kvgraft.oci import graft as ocigraft
from kvgraft.reference import Reference
from kvgraft.server import content
from kvgraft.server.context import Context
from kvgraft.server.endpoint import (
    endpoint_of,
    is_admin,
    json_body,
    principal_of,
    readable_event,
    require,
    require_admin,
)
from kvgraft.server.errors import OciError, digits
from kvgraft.services.prefixindex import RepositoryScope

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
    record = ctx.catalog.artifact(ctx.catalog.resolve(ref), ref.name)
    return {"digest": str(record.digest), "labels": dict(record.labels)}


def models(request: Request, ctx: Context) -> dict[str, Any]:
    """The models of artifacts in repositories the caller may read (an admin: all)."""
    from kvgraft.catalog.lookup import repositories

    principal = principal_of(request, ctx)
    if principal.token is None:
        raise ctx.refuse(request, principal, None, "pull")
    query = select(ModelRow).order_by(ModelRow.id)
    if not is_admin(principal):
        readable = [r for r in repositories(ctx.catalog)
                    if principal.may(ctx.settings, r, "pull")]
        query = query.where(ModelRow.id.in_(
            select(ArtifactRow.model_id)
            .join(RepositoryArtifactRow,
                  RepositoryArtifactRow.artifact_digest == ArtifactRow.digest)
            .where(RepositoryArtifactRow.repository.in_(readable))))
    with ctx.catalog._session() as s:
        rows = s.scalars(query).all()
        return {"models": [{"identity": r.identity, "name": r.name,
                            "architecture": r.architecture, "tokenizer": r.tokenizer,
                            "weights": r.weights} for r in rows]}


def log(request: Request, ctx: Context) -> dict[str, Any]:
    """A reference's history, as far as the caller may read it: by digest only through a
    repository that holds (or held) it, and only events in readable repositories. An
    unknown digest and one the caller may not see answer the same 404."""
    if request.query_params.get("ref"):
        ref = _ref(request)
        principal = require(request, ctx, ref.name, "pull")
        events = ctx.registry.log(ref)
        if ref.digest is not None and not _holds(ctx, ref.name, ref.digest, events):
            raise OciError(404, "MANIFEST_UNKNOWN", f"{ref.digest} is not in {ref.name}")
        events = tuple(e for e in events if readable_event(ctx, principal, e))
    else:  # the whole log names every repository: admin only
        require_admin(request, ctx)
        events = ctx.registry.log(None)
    return {"events": [{"id": e.id, "at": e.at.isoformat() if e.at else None,
                        "action": e.action, "actor": e.actor, "host": e.host,
                        "outcome": e.outcome, "repository": e.repository, "tag": e.tag,
                        "digest": str(e.digest) if e.digest else None,
                        "detail": dict(e.detail)} for e in events]}


def _holds(ctx: Context, repository: str, digest: Digest,
           events: tuple[EventRecord, ...]) -> bool:
    """Whether `repository` holds `digest`, or did (its history outlives a gc)."""
    if any(e.repository == repository for e in events):
        return True
    try:
        return repository in ctx.catalog.artifact(digest).repositories
    except NotFound:
        return False


def match(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    """The longest prefix among what the caller may read: the lookup itself is narrowed to
    readable repositories, so another tenant's graft neither answers nor hides one, and
    the answer names only readable `repository:tag`s. The query is a POST body (bounded
    like every JSON body: a 32k-token prompt is ~250 KB); `GET ?q=` stays for clients of
    earlier versions, whose URL limit refused prompts past ~7,500 tokens."""
    from kvgraft.catalog.lookup import repositories
    from kvgraft.services.match import match as prefix_match
    from kvgraft.services.prefixindex import CatalogPrefixIndex

    principal = principal_of(request, ctx)
    if request.method == "GET":
        raw = request.query_params.get("q")
        if raw is None or len(raw) > MAX_BODY:
            raise OciError(400, "UNSUPPORTED", 'POST {"model": {architecture, tokenizer, '
                           'weights}, "tokens": [...]}')
        body = json_body(raw.encode("utf-8", "replace"))
    identity, tokens, scope = _match_query(body)
    readable = frozenset(r for r in repositories(ctx.catalog)
                         if principal.may(ctx.settings, r, "pull")
                         and (scope is None or scope(r)))
    if not readable:
        return {"match": None}
    found = prefix_match(ctx.registry, identity, tokens,
                         index=CatalogPrefixIndex(ctx.catalog, within=readable))
    if found is None:
        return {"match": None}
    found = dataclasses.replace(found, references=tuple(
        r for r in found.references if r.partition(":")[0] in readable))
    return {"match": found.to_json()}


def token(request: Request, ctx: Context) -> dict[str, Any]:
    """The presented token's name, scopes and state (what `kvgraft doctor` reports)."""
    principal = principal_of(request, ctx)
    t = principal.token
    if t is None:
        return {"name": principal.name, "scopes": [], "state": "anonymous",
                "expires_at": None}
    return {"name": t.name, "scopes": [str(s) for s in t.scopes],
            "state": t.state(datetime.now(UTC)),
            "expires_at": t.expires_at.isoformat() if t.expires_at else None}


def stats(request: Request, ctx: Context) -> dict[str, Any]:
    """`kvgraft stats` through a server: the repositories the caller may pull."""
    principal = principal_of(request, ctx)
    pattern = request.query_params.get("pattern") or None
    report = ctx.catalog.usage(pattern,
                               visible=lambda r: principal.may(ctx.settings, r, "pull"))
    return report.to_json()


def _match_query(query: Any) -> tuple[ModelIdentity, list[int], RepositoryScope | None]:
    model, tokens = (query.get("model"), query.get("tokens")) if isinstance(query, dict) \
        else (None, None)
    if not isinstance(model, dict) or not isinstance(tokens, list) or not all(
            type(t) is int for t in tokens):
        raise OciError(400, "UNSUPPORTED", "a match query is {\"model\": {...}, "
                       "\"tokens\": [integers]}")
    patterns = query.get("repositories")
    if patterns is not None and (not isinstance(patterns, list) or len(patterns) > 64 or not all(
            isinstance(p, str) and 0 < len(p) <= 255 for p in patterns)):
        raise OciError(400, "UNSUPPORTED", "a match query's repositories are at most 64 "
                       "names or shell patterns")
    try:
        return (ModelIdentity.from_json(model), tokens,
                None if patterns is None else RepositoryScope(tuple(patterns)))
    except (ValueError, KeyError, TypeError, AttributeError, UsageError) as e:
        raise OciError(400, "UNSUPPORTED", f"malformed match query: {e}") from None


def stored(request: Request, ctx: Context) -> Response:
    """A graft blob exactly as stored (encoded, self-describing): what an HTTP remote's pull
    fetches into its machine cache and verifies there. `Range: bytes=N-` resumes. With
    `--redirect-blobs` and a store that presigns, a 307 to the store instead."""
    from starlette.responses import StreamingResponse

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
        Route(f"{PREFIX}/match", endpoint_of(match), methods=["GET"]),
        Route(f"{PREFIX}/match", endpoint_of(match, body="json"), methods=["POST"]),
        Route(f"{PREFIX}/stats", _guarded(stats), methods=["GET"]),
        Route(f"{PREFIX}/token", _guarded(token), methods=["GET"]),
        Route(f"{PREFIX}/stored/{{digest}}", _guarded(stored), methods=["GET"]),
    ]

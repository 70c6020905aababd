"""The read side of an HTTP remote's catalog under /kvgraft/v1/ (see catalogapi)."""

from __future__ import annotations

import fnmatch
from datetime import datetime
from typing import Any

from sqlalchemy import select
from starlette.requests import Request

from kvgraft.catalog.models import (
    ArtifactBlobRow,
    ArtifactRow,
    BlobRow,
    RepositoryArtifactRow,
)
from kvgraft.catalog.records import BlobRecord
from kvgraft.digest import Digest
from kvgraft.remote import wire
from kvgraft.server.auth import Principal
from kvgraft.server.context import Context
from kvgraft.server.endpoint import (
    MAX_ACTION,
    MAX_DIGESTS,
    digest_param,
    is_admin,
    principal_of,
    readable_event,
    repository_param,
    require_admin,
    visible_in,
)
from kvgraft.server.errors import OciError, digits

# --- reads ---------------------------------------------------------------------------


def record(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    digest = digest_param(request.path_params["digest"])
    visible = visible_in(request, ctx, digest)
    repository = request.query_params.get("repository") or None
    r = ctx.catalog.artifact(digest, repository if repository in visible else None)
    out = wire.artifact_json(r)
    out["repositories"] = list(visible)
    out["tags"] = [wire.tag_json(t) for t in r.tags if t.repository in visible]
    # Labels of the repositories the caller reads, never another tenant's.
    mine = {k: dict(v) for k, v in r.repository_labels.items() if k in visible}
    out["repository_labels"] = mine
    out["pinned"] = [p for p in r.pinned if p in visible]
    if not is_admin(principal_of(request, ctx)):  # another tenant's use of the same bytes
        out["last_used"] = None
    out["labels"] = mine.get(repository, {}) if repository else {
        k: v for repo in sorted(mine, reverse=True) for k, v in mine[repo].items()}
    return {"artifact": out}


def tags(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    principal = principal_of(request, ctx)
    pattern = request.query_params.get("pattern") or None
    if pattern is not None and len(pattern) > 512:
        raise OciError(400, "NAME_INVALID", "the pattern is longer than 512 characters")
    problems: list[str] = []
    found = ctx.catalog.list_tags(pattern, problems=problems)
    if pattern:
        found = tuple(t for t in found if fnmatch.fnmatchcase(t.repository, pattern))
    admin = is_admin(principal)
    return {"tags": [wire.tag_json(t) for t in found
                     if principal.may(ctx.settings, t.repository, "pull")],
            "problems": problems if admin else []}


def blob_records(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    principal = principal_of(request, ctx)
    wanted = body.get("digests") if isinstance(body, dict) else None
    if not isinstance(wanted, list) or len(wanted) > MAX_DIGESTS:
        raise OciError(400, "UNSUPPORTED", f"give at most {MAX_DIGESTS} digests")
    keys = [str(digest_param(str(d))) for d in wanted]
    out: dict[str, BlobRecord] = {}
    with ctx.catalog._session() as s:  # rows of blobs in readable repositories
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
    principal = principal_of(request, ctx)
    seen: dict[str, None] = {}
    with ctx.catalog._session() as s:
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
    digest = digest_param(q["digest"]) if q.get("digest") else None
    if digest is not None:
        visible_in(request, ctx, digest)
    else:  # the whole log names every repository: admin only
        require_admin(request, ctx)
    principal: Principal = request.state.principal
    limit = q.get("limit") or None
    if limit is not None and not digits(limit, 9):
        raise OciError(400, "UNSUPPORTED", "limit is a whole number below 10**9")
    action = q.get("action") or None
    if action is not None and len(action) > MAX_ACTION:
        raise OciError(400, "UNSUPPORTED", f"an action has at most {MAX_ACTION} characters")
    try:
        since = datetime.fromisoformat(q["since"]) if q.get("since") else None
    except ValueError as e:
        raise OciError(400, "UNSUPPORTED", f"bad since: {e}") from None
    found = ctx.catalog.events(digest=digest, action=action, since=since,
                               limit=int(limit) if limit else None)
    return {"events": [wire.event_json(e) for e in found
                       if readable_event(ctx, principal, e)]}


def attestations(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    """The attestations recorded in repositories the caller may read: another tenant's
    statement about the same bytes is neither shown nor counted by the caller's policy
    (docs/security.md)."""
    digest = digest_param(request.path_params["digest"])
    visible_in(request, ctx, digest)
    principal: Principal = request.state.principal
    homes = ctx.attestation_homes(digest)
    shown = {i for i, repos in homes.items()
             if is_admin(principal) or any(principal.may(ctx.settings, r, "pull")
                                           for r in repos)}
    catalog = ctx.catalog
    found = catalog.attestations(digest, request.query_params.get("predicate_type") or None)
    return {"attestations": [wire.attestation_json(a) for a in found if a.id in shown],
            "recorded": {str(k): v for k, v in catalog.attestation_digests(digest).items()
                         if k in shown}}


def children(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    digest = digest_param(request.path_params["digest"])
    visible_in(request, ctx, digest)
    principal: Principal = request.state.principal
    out = []
    for child in ctx.catalog.children(digest):
        repos = ctx.catalog.artifact(child).repositories
        if any(principal.may(ctx.settings, r, "pull") for r in repos):
            out.append(str(child))
    return {"children": out}


def event_chain(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    """Whether the event log's hash chain holds: counts and problems, no event contents,
    so any token may ask (an audit checks it)."""
    if principal_of(request, ctx).token is None:
        raise ctx.refuse(request, request.state.principal, None, "pull")
    catalog = ctx.catalog
    return {"chain": catalog.event_chain().to_json(),
            "trigger_problems": catalog.event_trigger_problems()}


def blob_info(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    """A blob this repository holds (or was sent), for a caller that may pull or push
    there: what a push asks before uploading."""
    repository = repository_param(request.query_params.get("repository"))
    principal = principal_of(request, ctx)
    if not (principal.may(ctx.settings, repository, "pull")
            or principal.may(ctx.settings, repository, "push")):
        raise ctx.refuse(request, principal, repository, "pull")
    digest = digest_param(request.path_params["digest"])
    info = None
    if ctx.oci.blob_size(repository, str(digest)) is not None:
        info = ctx.store.stat(digest)
    if info is None:
        raise OciError(404, "BLOB_UNKNOWN", f"blob {digest} is not in {repository}")
    return {"digest": str(digest), "stored_size": info.stored_size, "mtime": info.mtime}

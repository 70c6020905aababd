"""Pins, quotas and gc through a server, under /kvgraft/v1/ (what they mean:
kvgraft.catalog.lifecycle, kvgraft.transfer.gc). Pinning needs admin over the repository;
quotas bound what tenants may hold and gc deletes across all of them, so those need admin
over every repository."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from kvgraft.server.context import Context
from kvgraft.server.endpoint import (
    digest_param,
    event_fields,
    repository_param,
    require,
    require_admin,
    tag_param,
)
from kvgraft.server.errors import OciError

MAX_QUOTA = 2**63 - 1  # a BIGINT
MAX_SECONDS = 100 * 365 * 86400.0


def pin(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict) or not isinstance(body.get("pinned"), bool):
        raise OciError(400, "UNSUPPORTED", "give repository, digest and pinned (true/false)")
    repository = repository_param(body.get("repository"))
    require(request, ctx, repository, "admin")
    digest = digest_param(str(body.get("digest")))
    tag = tag_param(body["tag"]) if body.get("tag") is not None else None
    pinned: bool = body["pinned"]
    _, _, detail = event_fields(body)
    ctx.catalog.pin(repository, digest, pinned, ctx.event_record(
        request, "pin" if pinned else "unpin", repository=repository, tag=tag, digest=digest,
        detail=detail))
    return {}


def set_quota(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OciError(400, "UNSUPPORTED", "give repository and max_bytes")
    require_admin(request, ctx)
    repository = repository_param(body.get("repository"))
    limit = body.get("max_bytes")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)
                              or not 0 <= limit <= MAX_QUOTA):
        raise OciError(400, "UNSUPPORTED", f"max_bytes is a whole number of bytes from 0 to "
                       f"{MAX_QUOTA}, or null to remove the quota")
    _, _, detail = event_fields(body)
    previous = ctx.catalog.set_quota(repository, limit, ctx.event_record(
        request, "quota", repository=repository, detail=detail))
    return {"previous": previous}


def quotas(request: Request, ctx: Context, _: Any) -> dict[str, Any]:
    require_admin(request, ctx)
    return {"quotas": [q.to_json() for q in ctx.catalog.quotas()]}


def _duration(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 0 <= value <= MAX_SECONDS:
        raise OciError(400, "UNSUPPORTED", f"{key} is a number of seconds from 0 to "
                       f"{MAX_SECONDS:.0f}, or null")
    return float(value)


def gc(request: Request, ctx: Context, body: Any) -> dict[str, Any]:
    """Plan (`dry_run`) or run a gc of the server's catalog and store, as `kvgraft gc` on
    its host does; the plan is made here, whatever plan the client printed."""
    from kvgraft.transfer.gc import DEFAULT_GRACE, execute, plan

    if not isinstance(body, dict):
        raise OciError(400, "UNSUPPORTED", "give the gc's settings")
    require_admin(request, ctx)
    grace = _duration(body, "grace")
    made = plan(ctx.catalog, ctx.store, grace=DEFAULT_GRACE if grace is None else grace,
                untagged_older_than=_duration(body, "untagged_older_than"),
                unused_for=_duration(body, "unused_for"))
    if body.get("dry_run", True) is not False:
        return {"dry_run": True, "plan": made.to_json()}
    return execute(ctx.catalog, ctx.store, made,
                   ctx.event_record(request, "gc", detail={"store": ctx.store.url}),
                   allow_empty_catalog=body.get("allow_empty_catalog") is True).to_json()

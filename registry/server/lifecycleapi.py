"""Pins and quotas through a server, under /kvgraft/v1/ (what they mean:
kvgraft.catalog.lifecycle). Pinning needs admin over the repository; quotas bound what
tenants may hold, so setting or reading them needs admin over every repository."""

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

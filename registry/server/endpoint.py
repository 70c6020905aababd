"""What the /kvgraft/v1/ routes of an HTTP remote share: who is calling, what they may
see, bounded request bodies, and one error boundary (kvgraft.server.catalogapi)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from kvgraft import strictjson
from kvgraft.catalog.records import EventRecord
from kvgraft.digest import Digest
from kvgraft.errors import NotFound, RegistryError, UsageError
from kvgraft.reference import check_name, check_tag
from kvgraft.server.auth import Principal
from kvgraft.server.context import Context
from kvgraft.server.errors import OciError, digits

MAX_JSON = 16 << 20  # a push body: the manifest and its labels
MAX_DETAIL = 64 << 10  # the JSON of one event's detail
MAX_DIGESTS = 100_000
# The catalog's columns (kvgraft.catalog.models): checked here so that both databases
# refuse the same input with a 400 rather than PostgreSQL alone failing with a 500.
MAX_ACTION = 64
MAX_OUTCOME = 32
MAX_SHORT = 255  # media types, predicate types, key ids
# Events with their own endpoint (and checks): a client cannot log them as plain events.
# ("copy" can be: the source side of a copy logs one about an artifact already there, and
# only an artifact's first push or copy is its origin.)
RESERVED = frozenset({"push", "tag", "untag", "sign", "attest", "gc", "repair",
                      "token-create", "token-revoke", "pin", "unpin", "quota", "evict"})

Handler = Callable[[Request, Context, Any], Any]


def principal_of(request: Request, ctx: Context) -> Principal:
    principal = ctx.authenticate(request)
    request.state.principal = principal
    return principal


def require(request: Request, ctx: Context, repository: str, action: str) -> Principal:
    principal = principal_of(request, ctx)
    if not principal.may(ctx.settings, repository, action):
        raise ctx.refuse(request, principal, repository, action)
    return principal


def is_admin(principal: Principal) -> bool:
    return principal.token is not None and principal.token.is_admin


def require_admin(request: Request, ctx: Context) -> Principal:
    """A caller with admin over every repository (kvgraft.tokens.Token.is_admin): a
    repository named `*` does not exist, so checking a scope against that name would let
    a pattern matching it (`?`) pass."""
    principal = principal_of(request, ctx)
    if not is_admin(principal):
        raise ctx.refuse(request, principal, "*", "admin")
    return principal


def readable_event(ctx: Context, principal: Principal, event: EventRecord) -> bool:
    """An event the caller may read: one in a repository it may pull; one in no repository
    (whose actor and host could be anyone's) only for an admin."""
    if event.repository is None:
        return is_admin(principal)
    return principal.may(ctx.settings, event.repository, "pull")


def digest_param(text: str) -> Digest:
    try:
        return Digest.parse(text)
    except UsageError as e:
        raise OciError(400, "DIGEST_INVALID", e.human()) from None


def repository_param(text: Any) -> str:
    if not isinstance(text, str):
        raise OciError(400, "NAME_INVALID", "give the repository")
    try:
        check_name(text)
    except UsageError as e:
        raise OciError(400, "NAME_INVALID", e.human()) from None
    return text


def visible_in(request: Request, ctx: Context, digest: Digest,
             action: str = "pull") -> tuple[str, ...]:
    """The repositories holding `digest` in which the caller may `action`; an artifact it
    may not even pull is not found."""
    principal = principal_of(request, ctx)
    try:
        repos = ctx.catalog.artifact(digest).repositories
    except NotFound:
        repos = ()
    readable = tuple(r for r in repos if principal.may(ctx.settings, r, "pull"))
    if not readable:
        raise OciError(404, "NAME_UNKNOWN", f"artifact {digest} is not in the catalog")
    allowed = tuple(r for r in readable if principal.may(ctx.settings, r, action))
    if not allowed:
        raise ctx.refuse(request, principal, readable[0], action)
    return allowed


def event_fields(body: Any) -> tuple[str, str, dict[str, Any]]:
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
            len(action) > MAX_ACTION or len(outcome) > MAX_OUTCOME:
        raise OciError(400, "UNSUPPORTED", f"an event's action (at most {MAX_ACTION} "
                       f"characters) and outcome (at most {MAX_OUTCOME}) are short strings")
    return action, outcome, detail


def tag_param(value: Any) -> str:
    if not isinstance(value, str):
        raise OciError(400, "NAME_INVALID", "give the tag as a string")
    try:
        return check_tag(value)
    except UsageError as e:
        raise OciError(400, "NAME_INVALID", e.human()) from None


def short_text(value: Any, what: str, limit: int = MAX_SHORT) -> str:
    """A string that fits a `limit`-character column (already free of NUL: json_body)."""
    if not isinstance(value, str) or not value or len(value) > limit:
        raise OciError(400, "UNSUPPORTED", f"{what} is a string of 1 to {limit} characters")
    return value


def endpoint_of(fn: Handler, *,
                body: str | None = None) -> Callable[[Request], Awaitable[Response]]:
    """`body`: "json" reads a bounded JSON body; the handler runs on a worker thread."""

    async def endpoint(request: Request) -> Response:
        ctx: Context = request.app.state.ctx
        try:
            payload: Any = None
            if body == "json":
                _require_json(request)
                payload = json_body(await read_body(request, MAX_JSON))
            answer = await run_in_threadpool(fn, request, ctx, payload)
        except OciError as e:
            return e.response()
        except RegistryError as e:
            return ctx.registry_error(request, e).response()
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    return endpoint


def _require_json(request: Request) -> None:
    """A JSON body says so: a cross-site HTML form can send only text/plain, urlencoded or
    multipart bodies without the browser asking the server first (CORS preflight)."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise OciError(415, "UNSUPPORTED", "send the body as Content-Type: application/json")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not digits(declared) or int(declared) > limit):
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


def json_body(raw: bytes, code: str = "UNSUPPORTED") -> Any:
    """Untrusted JSON as the catalog can store it: bounded nesting and numbers, UTF-8
    strings without NUL, 64-bit integers (kvgraft.strictjson); anything else is a 400."""
    try:
        value = strictjson.loads(raw)
        strictjson.check_storable(value)
    except ValueError as e:
        raise OciError(400, code, f"the body is not JSON kvgraft accepts: {e}") from None
    return value

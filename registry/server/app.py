"""The ASGI application: routes, and one Registry per worker process.

Starlette (with uvicorn to serve it) because it is small, plain ASGI, and streams request
and response bodies without buffering them: blobs pass through as they come.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvgraft.client import Registry
from kvgraft.errors import RegistryError
from kvgraft.server import auth, catalogapi, kvapi, oci
from kvgraft.server.context import Context
from kvgraft.server.errors import OciError
from kvgraft.server.metrics import CONTENT_TYPE, MetricsMiddleware, ServerMetrics
from kvgraft.server.settings import ServerSettings

API_VERSION = "registry/2.0"
MAX_HEADER_BYTES = 64 << 10


class HeaderLimit:
    """Refuse requests whose headers exceed MAX_HEADER_BYTES in all (431), whichever HTTP
    parser uvicorn uses (h11 has a limit, httptools none), and URLs holding NUL (400)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and sum(
                len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            error = OciError(431, "SIZE_INVALID",
                             f"request headers exceed {MAX_HEADER_BYTES} bytes")
            await error.response()(scope, receive, send)
            return
        if scope["type"] == "http" and (b"%00" in scope["query_string"]
                                        or "\0" in scope["path"]):
            # No name, reference or search holds NUL, and PostgreSQL cannot compare
            # one: refused for every route alike, on either database.
            error = OciError(400, "UNSUPPORTED", "NUL in the request URL")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


_UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class SameOrigin:
    """Refuse (403) a write a browser sends on behalf of another site: a request with an
    unsafe method whose Origin header names another host than the one it was sent to. A
    browser attaches remembered Basic credentials to a cross-site form post; kvgraft,
    docker and other registry clients send no Origin, and the web page itself writes
    nothing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in _UNSAFE:
            headers = dict(scope["headers"])
            origin = headers.get(b"origin")
            if origin is not None and urlsplit(origin.decode("latin-1")).netloc.lower() \
                    != headers.get(b"host", b"").decode("latin-1").lower():
                error = OciError(403, "DENIED", "a write from another site's page is refused "
                                 f"(Origin {origin.decode('latin-1')[:100]})")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def base(request: Request) -> Response:
    """`GET /v2/`: 200 for a caller with a valid token, else a 401 challenge."""
    ctx: Context = request.app.state.ctx
    try:
        principal = await run_in_threadpool(ctx.authenticate, request)
        if principal.token is None:
            raise ctx.refuse(request, principal, None, "pull")
    except OciError as e:
        e.headers["Docker-Distribution-API-Version"] = API_VERSION
        return e.response()
    return JSONResponse({}, headers={"Docker-Distribution-API-Version": API_VERSION})


async def token_endpoint(request: Request) -> Response:
    """The Distribution token flow: Basic credentials (the password is a kvgraft token) in,
    a bearer token out. The bearer token is the presented token itself, so nothing is issued
    that could outlive a revocation; without credentials it is the anonymous token."""
    ctx: Context = request.app.state.ctx
    try:
        principal = await run_in_threadpool(ctx.authenticate, request)
    except OciError as e:
        return e.response()
    secret = auth.presented_secret(request) if principal.token else auth.ANONYMOUS
    now = datetime.now(UTC)
    expires = principal.token.expires_at if principal.token else None
    ttl = int((expires - now).total_seconds()) if expires else 3600
    return JSONResponse({"token": secret, "access_token": secret,
                         "expires_in": max(ttl, 1), "issued_at": now.isoformat()},
                        headers={"Cache-Control": "no-store"})


async def metrics_endpoint(request: Request) -> Response:
    """`GET /metrics`: Prometheus' text format, for a token with the admin scope on `*`
    (what the whole audit log needs too) or for anyone under `--metrics-public`."""
    ctx: Context = request.app.state.ctx
    if not ctx.settings.metrics_public:
        try:
            principal = await run_in_threadpool(ctx.authenticate, request)
            if not principal.may(ctx.settings, "*", "admin"):
                raise ctx.refuse(request, principal, "*", "admin")
        except OciError as e:
            return e.response()
    metrics: ServerMetrics = request.app.state.metrics
    body = await run_in_threadpool(metrics.exposition)
    return Response(body, media_type=CONTENT_TYPE, headers={"Cache-Control": "no-store"})


def create_app(registry_factory: Callable[[], Registry], settings: ServerSettings, *,
               extra_routes: Sequence[BaseRoute] = (), pages: bool = True) -> Starlette:
    """The application. `registry_factory` runs once per worker, at start-up; routes in
    `extra_routes` are mounted after the APIs and see the same `request.app.state.ctx`;
    `pages` adds the web page at `/`."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        registry = await run_in_threadpool(registry_factory)
        app.state.ctx = Context(registry, settings)
        app.state.ctx.metrics = metrics
        await run_in_threadpool(lambda: app.state.ctx.oci)  # catalog opened and checked
        try:
            yield
        finally:
            registry.close()

    async def on_registry_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RegistryError)
        ctx: Context = request.app.state.ctx
        return ctx.registry_error(request, exc).response()

    routes: list[BaseRoute] = [
        Route("/v2/", base, methods=["GET", "HEAD"]),
        Route("/v2/token", token_endpoint, methods=["GET", "POST"], name="token_endpoint"),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v2/{rest:path}", oci.dispatch,
              methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]),
        *kvapi.routes(),
        *catalogapi.routes(),
        *extra_routes,
    ]
    metrics = ServerMetrics(settings.upload_dir)
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={RegistryError: on_registry_error},
                    middleware=[Middleware(MetricsMiddleware, metrics=metrics),
                                Middleware(HeaderLimit), Middleware(SameOrigin)])
    app.state.metrics = metrics
    if pages:
        app.router.routes.extend(_web_pages(app))
    return app


def _web_pages(app: Starlette) -> list[BaseRoute]:
    """The web page (kvgraft.server.web), reading through this app's registry and showing
    each viewer only the repositories its token may pull."""
    from kvgraft.server.web import web_routes

    def access(request: Request) -> Callable[[str], bool]:
        ctx: Context = request.app.state.ctx
        try:
            principal = ctx.authenticate(request)
        except OciError as e:
            raise PermissionError(str(e)) from None
        return lambda repository: principal.may(ctx.settings, repository, "pull")

    def current_registry() -> Registry:
        registry: Registry = app.state.ctx.registry
        return registry

    return web_routes(current_registry, access=access)



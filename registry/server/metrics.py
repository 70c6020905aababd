"""Prometheus metrics of `kvgraft serve` (`GET /metrics`), kept by prometheus_client.

Requests are counted by route template (`/v2/{name}/blobs/{digest}`, never the raw path:
a label's values stay bounded whatever clients ask for), method and status, with bytes in
and out, and latency measured until the last byte of the response is handed to the server.
401 and 403 answers are refused authentications; catalog and store errors are counted where
the server turns a library error into a response (`Context.registry_error`) and where a
request fails with an exception nothing handled. Open uploads are counted at scrape time
from the upload directory, which every worker shares, so the figure is the server's.

With several uvicorn workers, each is its own process: `kvgraft serve` then gives them one
directory of its own for prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR,
set before any worker starts and emptied when the server starts and stops), and every
scrape, whichever worker answers it, sums the counters and histograms of all of them,
including those of workers that have exited. With one worker the process's own figures are
the server's.

prometheus_client is imported only here, and only when an application is built: the
multiprocess choice is made by prometheus_client when it is first imported, which must
come after `kvgraft serve` has set the directory.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgraft.errors import MissingExtra, Unavailable

if TYPE_CHECKING:
    from prometheus_client.core import Metric

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
UNMATCHED = "unmatched"  # the route label of a request no route matched (404)
# Seconds: a manifest or tag answer takes milliseconds, a blob stream many seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0)
# The OCI routes share one Starlette route (`/v2/{rest:path}`: repository names hold
# slashes); their templates are told apart by the path's tail.
_OCI = re.compile(r"/v2/.+?/(?:blobs/uploads/(?P<upload>[^/]*)|blobs/(?P<blob>[^/]+)"
                  r"|manifests/(?P<ref>[^/]+)|(?P<tags>tags/list)|referrers/(?P<subject>[^/]+))")
_OCI_TEMPLATES = {"blob": "/v2/{name}/blobs/{digest}", "ref": "/v2/{name}/manifests/{reference}",
                  "tags": "/v2/{name}/tags/list", "subject": "/v2/{name}/referrers/{digest}"}


def route_template(scope: Scope) -> str:
    """The route a request was served by, as its template; UNMATCHED when none matched."""
    path = getattr(scope.get("route"), "path", None)
    if not isinstance(path, str):
        return UNMATCHED
    if path != "/v2/{rest:path}":
        return path
    m = _OCI.fullmatch(scope.get("path", ""))
    if m is None:
        return UNMATCHED
    if m.group("upload") is not None:
        return "/v2/{name}/blobs/uploads/" + ("{uuid}" if m.group("upload") else "")
    return next(t for g, t in _OCI_TEMPLATES.items() if m.group(g) is not None)


def backend_of(error: BaseException) -> str:
    """Which backend an error came from: the deepest kvgraft catalog or blob store frame
    (or SQLAlchemy's, or boto's) of its traceback; `other` when neither."""
    found = "other"
    tb = error.__traceback__
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        if module.startswith(("kvgraft.catalog", "sqlalchemy", "alembic", "psycopg")):
            found = "catalog"
        elif module.startswith(("kvgraft.blobstore", "botocore", "boto3")):
            found = "store"
        tb = tb.tb_next
    return found


class ServerMetrics:
    """One worker's metrics, and the scrape of the whole server."""

    def __init__(self, upload_dir: Path) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Histogram
        except ImportError:
            raise MissingExtra("kvgraft serve's metrics", "server") from None
        self.upload_dir = upload_dir
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV) or None
        # A registry of this app's own, not the process-wide default one: two apps in one
        # process (tests) do not collide, and nothing else a process imports is exported.
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvgraft_http_requests", "Requests answered, by route "
                                "template, method and status.",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram("kvgraft_http_request_duration_seconds",
                                 "From a request's arrival to its response's last byte.",
                                 ["route", "method"], buckets=LATENCY_BUCKETS, registry=r)
        self.bytes_in = Counter("kvgraft_http_request_bytes", "Request body bytes received.",
                                ["route"], registry=r)
        self.bytes_out = Counter("kvgraft_http_response_bytes", "Response body bytes sent.",
                                 ["route"], registry=r)
        self.refused = Counter("kvgraft_auth_refused", "Requests refused for want of valid "
                               "credentials (401) or of a scope (403).", ["status"],
                               registry=r)
        self.errors = Counter("kvgraft_backend_errors", "Catalog and blob store failures "
                              "met while answering requests.", ["backend", "kind"],
                              registry=r)
        self.uploads = _Uploads(upload_dir)
        r.register(self.uploads)

    def backend_error(self, error: BaseException) -> None:
        """Count a library error that reached a response, if it is a backend's failure."""
        if isinstance(error, Unavailable):
            self.errors.labels(backend_of(error), "unavailable").inc()

    def crashed(self, error: BaseException) -> None:
        self.errors.labels(backend_of(error), "unhandled").inc()

    def observe(self, route: str, method: str, status: int, seconds: float, received: int,
                sent: int) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)
        if received:
            self.bytes_in.labels(route).inc(received)
        if sent:
            self.bytes_out.labels(route).inc(sent)
        if status in (401, 403):
            self.refused.labels(str(status)).inc()

    def exposition(self) -> bytes:
        """The text a scrape answers: every worker's figures (multiprocess mode) or this
        process's, and the open uploads."""
        from prometheus_client import CollectorRegistry, generate_latest

        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        scrape = CollectorRegistry()  # one per scrape: scrapes may run side by side
        multiprocess.MultiProcessCollector(  # type: ignore[no-untyped-call]
            scrape, path=self.multiprocess_dir)
        scrape.register(self.uploads)
        return generate_latest(scrape)


class _Uploads:
    """Open uploads, counted in the directory every worker shares."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            n = sum(1 for p in self.root.iterdir()
                    if p.suffix == ".json" or p.name.startswith(".mono-"))
        except OSError:
            n = 0
        yield GaugeMetricFamily("kvgraft_open_uploads", "Blob uploads started and not yet "
                                "finished or expired, in all workers.", value=n)


class MetricsMiddleware:
    """Measures every HTTP request the application answers."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state: dict[str, Any] = {"in": 0, "out": 0, "status": 500, "done": False}

        async def counted_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["in"] += len(message.get("body", b""))
            return message

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = int(message["status"])
            elif message["type"] == "http.response.body":
                state["out"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counted_receive, counted_send)
        except Exception as e:
            self.metrics.crashed(e)
            state["status"] = 500
            raise
        finally:
            self.metrics.observe(route_template(scope), scope.get("method", ""),
                                 state["status"], time.perf_counter() - started,
                                 state["in"], state["out"])


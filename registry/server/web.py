"""The registry's web page: repositories and tags with search, and one page per artifact
(model identity, sizes, shared chunks, lineage graph, provenance, attestations with their
verification result, audit events).

Server-rendered HTML from Jinja2 templates with autoescaping on; read-only; no script.
The application mounts these routes beside its API:

    Starlette(routes=[*api_routes, *web_routes(lambda: registry)])

`open_registry` is called on every request and returns the application's Registry (the
routes never close it). Handlers are synchronous methods: Starlette runs them in its thread
pool, so blocking catalog queries do not stall the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from http import HTTPStatus
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.templating import Jinja2Templates

from kvgraft.catalog.browse import Listing, Search, search
from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import NotFound, RegistryError, Unavailable, UsageError
from kvgraft.reference import Reference, check_name
from kvgraft.server.context import server_catalog
from kvgraft.server.lineage import svg
from kvgraft.server.views import artifact_view, everything

PAGE_SIZE = 200
# The pages run no script and load nothing from elsewhere: a policy that says so turns
# any markup that slipped past escaping into inert text.
HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' "
                               "data:; form-action 'self'; base-uri 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
_QUERY_MAX = 512  # longer search text is refused, not matched


def human_size(n: int | None) -> str:
    if n is None:
        return "—"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _when(t: datetime | None) -> str:
    return "—" if t is None else t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _templates() -> Jinja2Templates:
    env = Environment(loader=PackageLoader("kvgraft.server", "templates"), autoescape=True,
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["size"] = human_size
    env.filters["when"] = _when
    return Jinja2Templates(env=env)


def _status(e: RegistryError) -> int:
    if isinstance(e, NotFound):
        return 404
    if isinstance(e, UsageError):
        return 400
    if isinstance(e, Unavailable):
        return 503
    return 500


def _groups(rows: list[Listing]) -> list[tuple[str, list[Listing]]]:
    out: dict[str, list[Listing]] = {}
    for r in rows:
        out.setdefault(r.repository, []).append(r)
    return list(out.items())


Visible = Callable[[str], bool]
Access = Callable[[Request], Visible]
_CHALLENGE = {"WWW-Authenticate": 'Basic realm="kvgraft", charset="UTF-8"'}


def web_routes(open_registry: Callable[[], Registry], *,
               access: Access | None = None) -> list[BaseRoute]:
    """The page's routes. `access(request)` authenticates a request once and returns which
    repositories it may read (the server's pull scope); it raises PermissionError for
    credentials it refuses. Without it every repository is visible (a trusted network).
    Browsers send credentials by Basic auth: any user name, the token as the password."""
    templates = _templates()
    templates.env.globals["sign_in"] = access is not None
    pages = _Pages(templates, open_registry, access)
    get = ["GET", "HEAD"]
    return [
        Route("/", pages.index, methods=get, name="web_index"),
        Route("/ui/login", pages.login, methods=get, name="web_login"),
        Route("/ui/r/{name:path}", pages.repository, methods=get, name="web_repository"),
        Route("/ui/a/{digest}", pages.artifact, methods=get, name="web_artifact"),
        Route("/ui/ref/{ref:path}", pages.reference, methods=get, name="web_reference"),
    ]


@dataclass(frozen=True)
class _Pages:
    """The handlers, over one way to open the registry and one access check."""

    templates: Jinja2Templates
    open_registry: Callable[[], Registry]
    access: Access | None

    def render(self, request: Request, name: str, status: int = 200,
               headers: dict[str, str] | None = None, **context: object) -> Response:
        return self.templates.TemplateResponse(request, name, context, status_code=status,
                                               headers={**HEADERS, **(headers or {})})

    def failed(self, request: Request, e: RegistryError, code: int | None = None,
               headers: dict[str, str] | None = None) -> Response:
        code = code or _status(e)
        return self.render(request, "error.html", code, headers, error=e,
                           status_text=HTTPStatus(code).phrase)

    def viewer(self, request: Request) -> Visible:
        return everything if self.access is None else self.access(request)

    def hidden(self, request: Request, e: NotFound) -> Response:
        """What a viewer gets for something it may not read: without credentials, a
        challenge (the browser asks for a token), whether or not it exists; with them,
        the same answer as for something that does not exist. A page with no access
        rule (everything readable) hides nothing: a plain 404."""
        if self.access is None or "authorization" in request.headers:
            return self.failed(request, e)
        return self.failed(request, RegistryError(
            "this needs a token with pull access",
            hint="sign in with any user name and the token as the password"), 401, _CHALLENGE)

    def unauthorised(self, request: Request, e: PermissionError) -> Response:
        return self.failed(request, RegistryError(f"credentials refused: {e}"), 401, _CHALLENGE)

    def listing(self, request: Request, repository: str | None) -> Response:
        p = request.query_params
        query = Search(name=p.get("q", ""), label=p.get("label", ""),
                       model=p.get("model", ""), repository=repository)
        try:
            visible = self.viewer(request)
            if repository is not None and not visible(repository):
                return self.hidden(request,
                                   NotFound(f"repository {repository} is not in the catalog"))
            offset = _offset(query, p.get("offset", "0"))
            rows, more = search(server_catalog(self.open_registry()), query, limit=PAGE_SIZE,
                                offset=offset)
        except PermissionError as e:
            return self.unauthorised(request, e)
        except RegistryError as e:
            return self.failed(request, e)
        rows = [r for r in rows if visible(r.repository)]
        if repository is not None and not rows and not offset and not (
                query.name or query.label or query.model):
            return self.failed(request, NotFound(
                f"repository {repository} is not in the catalog",
                hint="`kvgraft ls` lists what the catalog holds"))
        nxt = None
        if more:
            keep = {k: v for k, v in p.items() if k != "offset" and v}
            nxt = "?" + urlencode({**keep, "offset": offset + PAGE_SIZE})
        return self.render(request, "index.html", query=query, groups=_groups(rows),
                           count=len(rows), offset=offset, next_page=nxt)

    def index(self, request: Request) -> Response:
        return self.listing(request, None)

    def repository(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            check_name(name)
        except UsageError as e:
            return self.failed(request, e)
        return self.listing(request, name)

    def artifact(self, request: Request) -> Response:
        try:
            digest = Digest.parse(request.path_params["digest"])
            view = artifact_view(self.open_registry(), digest, self.viewer(request))
        except PermissionError as e:
            return self.unauthorised(request, e)
        except NotFound as e:  # missing or hidden: one answer, so neither is an oracle
            return self.hidden(request, e)
        except RegistryError as e:  # a corrupt manifest too: said, never shown
            return self.failed(request, e)

        def href(d: Digest) -> str:
            return str(request.url_for("web_artifact", digest=str(d)))

        return self.render(request, "artifact.html", view=view,
                           lineage_svg=svg(view.lineage, href))

    def reference(self, request: Request) -> Response:
        try:
            ref = Reference.parse(request.path_params["ref"])
            if not self.viewer(request)(ref.name):
                return self.hidden(request, NotFound(f"{ref} is not in the catalog"))
            digest = self.open_registry().resolve(ref)
        except PermissionError as e:
            return self.unauthorised(request, e)
        except RegistryError as e:
            return self.failed(request, e)
        return RedirectResponse(request.url_for("web_artifact", digest=str(digest)), 302)

    def login(self, request: Request) -> Response:
        """Ask the browser for credentials, then go back to the listing."""
        try:
            self.viewer(request)
        except PermissionError as e:
            return self.unauthorised(request, e)
        if "authorization" not in request.headers:
            return self.failed(request, RegistryError(
                "sign in with a token", hint="any user name; the token as password"),
                401, _CHALLENGE)
        return RedirectResponse(request.url_for("web_index"), 303)


def _offset(query: Search, given: str) -> int:
    """The listing's offset, once the search text is known to be short enough."""
    if max(len(query.name), len(query.label), len(query.model)) > _QUERY_MAX:
        raise UsageError(f"search text is longer than {_QUERY_MAX} characters")
    if not (given.isascii() and given.isdigit() and len(given) <= 9):
        raise UsageError("offset must be a whole number below 10**9")
    return int(given)

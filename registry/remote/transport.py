"""The one HTTP/1.1 client of kvgraft: the server remote, the OCI client and the presigned
blob URLs a server redirects to all speak through it.

Connections are kept alive and reused per host from a pool shared by every thread (a pull
fetches on several). A request that is safe to repeat (GET, HEAD, PUT of the same bytes)
is sent again on a fresh connection when one breaks; any other (POST: an untag, an event)
goes out on a fresh connection and is never repeated. Redirects are followed for GET and
HEAD, and the credentials never leave the origin they are for: a presigned store URL
carries its own signature, and S3 refuses a request with an Authorization header too.
Bodies read whole are bounded; an answer that is not wanted becomes a RegistryError
through the one map below (`answer_error`), which names who answered: the origin itself
(a kvgraft server or an OCI registry, JSON errors) or a store it redirected to (XML).
Only the standard library speaks HTTP here, so a client needs no extra.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import re
import ssl
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlencode, urljoin, urlsplit

from kvgraft.digest import Buffer
from kvgraft.errors import (
    AuthRefused,
    Conflict,
    IntegrityError,
    NotFound,
    QuotaExceeded,
    RegistryError,
    Unavailable,
    UsageError,
)

TIMEOUT = 60.0
RETRIES = 3  # times a request that is safe to repeat is sent again after a broken line
REDIRECTS = 5
IDLE_PER_HOST = 16
MAX_ERROR_BODY = 64 << 10
MAX_TOKEN_BODY = 64 << 10
PIECE = 1 << 20
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT"})
_REDIRECTED = frozenset({301, 302, 303, 307, 308})
# OCI error codes that mean the content itself is wrong (exit 4), whatever the status.
_INTEGRITY_CODES = frozenset({"DIGEST_INVALID", "MANIFEST_INVALID", "MANIFEST_BLOB_UNKNOWN",
                              "BLOB_UPLOAD_INVALID", "SIZE_INVALID"})
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')

Body = Buffer | list[Buffer] | tuple[Buffer, ...]


@dataclass(frozen=True, slots=True)
class Peer:
    """Who answers at a transport's origin, for the words of its errors."""

    name: str  # "the kvgraft server"
    short: str  # "the server": what redirected to a store URL
    credentials_hint: str  # for a 401 or 403
    store_hint: str  # for a store that refused the URL it was redirected to
    store_reach_hint: str  # for a store that could not be reached


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


# --- the one map from an answer to an error ------------------------------------------------


def _said(body: bytes) -> tuple[str, str]:
    """(code, message) of an OCI JSON error body or an S3 XML one; empty if neither."""
    try:
        first = json.loads(body)["errors"][0]
        return str(first.get("code", "")), str(first.get("message", ""))[:300]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        pass
    text = body.decode("utf-8", "replace")
    code, message = (re.search(rf"<{tag}>([^<]*)</{tag}>", text) for tag in ("Code", "Message"))
    return (code.group(1) if code else ""), (message.group(1) if message else "")


def answer_error(status: int, reason: str, body: bytes, url: str, base: str, peer: Peer,
                 what: str) -> RegistryError:
    """The RegistryError for an answer not wanted: `status` from `url`, asked of `base`."""
    code, message = _said(body)
    if origin(url) != base:  # a store the origin redirected to (a presigned URL)
        detail = " ".join(p for p in (code, message) if p) or f"{status} {reason}"
        where = urlsplit(url).netloc
        if status == 404:
            return NotFound(f"{what}: the blob store at {where} has no such object ({detail})")
        return Unavailable(f"{what}: the blob store at {where} refused the URL {peer.short} "
                           f"redirected to: {detail}", hint=peer.store_hint)
    text = message or f"{code} {reason}".strip()
    if status == 401:
        return AuthRefused(f"{what}: {base} refused the credentials: {text}",
                           hint=peer.credentials_hint)
    if status == 403:
        return AuthRefused(f"{what}: {base} denied it: {text}", hint=peer.credentials_hint)
    if status == 404:
        return NotFound(f"{what}: {text}")
    if code in _INTEGRITY_CODES:
        return IntegrityError(f"{what}: {text}")
    if code == QuotaExceeded.oci_code:
        return QuotaExceeded(f"{what}: {text}")
    if status == 409:
        return Conflict(f"{what}: {text}")
    if status < 500:
        return UsageError(f"{what}: {text}")
    return Unavailable(f"{what}: {peer.name} at {base} answered {status}: {text}")


def unreachable(url: str, base: str, peer: Peer, what: str, reason: object) -> Unavailable:
    if origin(url) != base:
        return Unavailable(f"{what}: cannot reach the blob store at {urlsplit(url).netloc} "
                           f"that {peer.short} redirected to: {reason}",
                           hint=peer.store_reach_hint)
    return Unavailable(f"{what}: cannot reach {peer.name} at {base}: {reason}")


# --- answers ------------------------------------------------------------------------------


class Response:
    """An answer whose body is still to be read: whole and bounded (`read`), or streamed
    (`pieces`). Closing it hands a connection whose body was read back to the pool."""

    def __init__(self, transport: Transport, raw: http.client.HTTPResponse,
                 conn: http.client.HTTPConnection, url: str) -> None:
        self.transport, self.raw, self.conn, self.url = transport, raw, conn, url
        self.status = raw.status
        self.headers = raw.headers
        self._body: bytes | None = None  # read ahead (an error's body)
        self._closed = False

    def header(self, name: str) -> str | None:
        return self.raw.getheader(name)

    def read(self, limit: int, what: str) -> bytes:
        """The whole body, refused if longer than `limit`; the connection goes back."""
        if self._body is not None:
            return self._body
        declared = self.header("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            self.close()
            raise IntegrityError(f"{what} is {declared} bytes, more than the {limit} expected")
        try:
            data = self.raw.read(limit + 1)
        finally:
            self.close()
        if len(data) > limit:
            raise IntegrityError(f"{what} is longer than the {limit} bytes expected")
        return data

    def pieces(self, limit: int | None = None) -> Iterator[bytes]:
        """The body as it comes (at most `limit` bytes); what arrived before a cut too, so a
        resume starts after it (the cut itself is raised: IncompleteRead or an OSError)."""
        left = limit
        while left is None or left > 0:
            try:
                piece = self.raw.read(PIECE if left is None else min(PIECE, left))
            except http.client.IncompleteRead as e:
                if e.partial:
                    yield bytes(e.partial)
                raise
            if not piece:
                return
            if left is not None:
                left -= len(piece)
            yield piece

    def buffer(self) -> bytes:
        """Read the (error's, bounded) body now, so the line is free for the next request."""
        if self._body is None:
            try:
                self._body = self.raw.read(MAX_ERROR_BODY)
            except (OSError, http.client.HTTPException):
                self._body = b""
            self.close()
        return self._body

    def error(self, what: str) -> RegistryError:
        """The typed error this answer means (see answer_error)."""
        return answer_error(self.status, self.raw.reason, self.buffer(), self.url,
                            self.transport.url, self.transport.peer, what)

    def expect(self, ok: tuple[int, ...], what: str) -> Response:
        if self.status not in ok:
            raise self.error(what)
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.raw.isclosed():
            length = self.raw.length
            if length is not None and length <= MAX_ERROR_BODY:
                # A short rest (an empty body, a HEAD): read it, and the line is kept.
                with contextlib.suppress(OSError, http.client.HTTPException):
                    self.raw.read()
        self.transport._give(self.url, self.conn, reusable=self.raw.isclosed())

    def __enter__(self) -> Response:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class JsonApi(Protocol):
    """A kvgraft server's JSON API (kvgraft.remote.http.HttpRemote), as the HTTP catalog
    uses it: one request, its decoded JSON answer."""

    @property
    def url(self) -> str: ...

    def send(self, method: str, path: str, body: Any = None, *, what: str) -> Any: ...

    def close(self) -> None: ...


# --- credentials --------------------------------------------------------------------------


class Auth(Protocol):
    """What a transport sends as Authorization to its own origin."""

    def header(self, scope: str | None) -> str | None:
        """The header to send first (None: none yet)."""

    def challenged(self, answer: Response, scope: str | None,
                   transport: Transport) -> str | None:
        """A header to try after `answer` (a 401), or None to give up."""


@dataclass(frozen=True, slots=True)
class BearerToken:
    """A token the origin issued (kvgraft serve): sent as it is, never renegotiated."""

    token: str

    def header(self, scope: str | None) -> str | None:
        return f"Bearer {self.token}"

    def challenged(self, answer: Response, scope: str | None,
                   transport: Transport) -> str | None:
        return None


@dataclass(frozen=True, slots=True)
class Credentials:
    username: str
    secret: str

    def basic(self) -> str:
        raw = f"{self.username}:{self.secret}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")


class Challenged:
    """Credentials answered the way the origin asks for them (`WWW-Authenticate`): Basic
    with the user and secret, or the Distribution token flow (the realm is asked, with
    Basic credentials when there are some, for a bearer token for the scope)."""

    def __init__(self, credentials: Credentials | None) -> None:
        self.credentials = credentials
        self._answers: dict[str | None, str] = {}  # scope → the header that was accepted
        self._lock = threading.Lock()

    def header(self, scope: str | None) -> str | None:
        with self._lock:
            return self._answers.get(scope)

    def challenged(self, answer: Response, scope: str | None,
                   transport: Transport) -> str | None:
        header = self._answer(answer, scope, transport)
        if header is not None:
            with self._lock:
                self._answers[scope] = header
        return header

    def _answer(self, answer: Response, scope: str | None,
                transport: Transport) -> str | None:
        kind, _, params = (answer.header("WWW-Authenticate") or "").partition(" ")
        if kind.lower() == "basic":
            return self.credentials.basic() if self.credentials else None
        fields = dict(_CHALLENGE_PARAM.findall(params))
        realm = fields.get("realm")
        if kind.lower() != "bearer" or not realm:
            return None
        query = {k: v for k, v in (("scope", scope), ("service", fields.get("service")))
                 if v is not None}
        sep = "&" if "?" in realm else "?"
        what = f"a token for {scope} from {realm}"
        headers = {"Authorization": self.credentials.basic()} if self.credentials else {}
        with transport.request("GET", f"{realm}{sep}{urlencode(query)}", headers=headers,
                               what=what, authorize=False) as r:
            if r.status in (401, 403):
                said = _said(r.buffer())[1] or f"{r.status} {r.raw.reason}"
                raise AuthRefused(f"{realm} refused the credentials for {scope}: {said}",
                                  hint=transport.peer.credentials_hint)
            if r.status != 200:
                raise Unavailable(f"{what}: answered {r.status} {r.raw.reason}")
            try:
                doc = json.loads(r.read(MAX_TOKEN_BODY, what))
                token = doc.get("token") or doc.get("access_token")
            except (ValueError, AttributeError):
                token = None
        if not isinstance(token, str) or not token:
            raise RegistryError(f"{realm} answered no token for {scope}")
        return f"Bearer {token}"


# --- the transport ------------------------------------------------------------------------


class Transport:
    """HTTP to one origin (and what it redirects to); thread-safe, connections pooled."""

    def __init__(self, url: str, peer: Peer, *, auth: Auth | None = None,
                 cafile: Path | None = None, timeout: float = TIMEOUT,
                 retries: int = RETRIES) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError(f"not an http(s) URL: {url!r}")
        self.url = f"{parts.scheme}://{parts.netloc}"
        self.peer, self.auth, self.cafile = peer, auth, cafile
        self.timeout, self.retries = timeout, retries
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None

    def request(self, method: str, target: str, *, body: Body | None = None,
                headers: Mapping[str, str] | None = None, what: str,
                scope: str | None = None, authorize: bool = True,
                safe: bool = False) -> Response:
        """Send `method` to `target` (a path on the origin, or a full URL), follow
        redirects of a GET or HEAD, answer one auth challenge; the answer, whatever its
        status (Response.expect turns an unwanted one into the typed error). `safe`: a
        POST that only reads (a query too long for a URL), repeated like a GET."""
        url = target if "://" in target else self.url + target
        auth = self.auth if authorize else None
        authorization = auth.header(scope) if auth else None
        challenged = False
        for _ in range(REDIRECTS + 1):
            send = dict(headers or {})
            if authorization and origin(url) == self.url:
                send["Authorization"] = authorization
            r = self._send(method, url, body, send, what, safe)
            if r.status == 401 and auth is not None and not challenged:
                challenged = True  # once: a second 401 means the credentials are refused
                r.buffer()  # the realm is asked next, and this line is free for it
                fresh = auth.challenged(r, scope, self)
                if fresh is not None:
                    authorization = fresh
                    continue
            if r.status not in _REDIRECTED or method not in ("GET", "HEAD"):
                return r
            location = r.header("Location")
            r.close()
            if not location:
                raise Unavailable(f"{what}: {url} redirected without a Location")
            url = urljoin(url, location)
        raise Unavailable(f"{what}: more than {REDIRECTS} redirects from {self.url}")

    def call(self, method: str, target: str, *, body: Body | None = None,
             headers: Mapping[str, str] | None = None, what: str, limit: int,
             ok: tuple[int, ...] = (200, 201, 202, 204), safe: bool = False) -> bytes:
        """One request whose answer is read whole (at most `limit` bytes); a body cut
        short is asked for again when the request is safe to repeat."""
        tries = self.retries + 1 if method in IDEMPOTENT or safe else 1
        for attempt in range(tries):
            r = self.request(method, target, body=body, headers=headers, what=what, safe=safe)
            r.expect(ok, what)
            try:
                return r.read(limit, what)
            except RegistryError:  # a ConnectionError or PermissionError too: not a cut
                raise
            except (OSError, http.client.HTTPException) as e:
                if attempt == tries - 1:
                    raise unreachable(r.url, self.url, self.peer, what, e) from None
        raise AssertionError("unreachable")

    def _send(self, method: str, url: str, body: Body | None, headers: dict[str, str],
              what: str, safe: bool = False) -> Response:
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if body is not None:
            size = sum(memoryview(b).nbytes for b in body) \
                if isinstance(body, list | tuple) else memoryview(body).nbytes
            headers["Content-Length"] = str(size)
        repeatable = method in IDEMPOTENT or safe
        tries, stale = (self.retries + 1 if repeatable else 1), 1
        while True:
            # Only what may be repeated rides a kept-alive line: one the server has
            # since closed fails, and a POST must not be sent twice.
            conn, reused = self._take(url, reuse=repeatable)
            try:
                conn.request(method, path, body=body, headers=headers)
                return Response(self, conn.getresponse(), conn, url)
            except ssl.SSLCertVerificationError as e:
                conn.close()
                raise unreachable(url, self.url, self.peer, what, e) from None
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if reused and stale:
                    # Idle as long as this one, the others are likely closed too.
                    stale -= 1
                    self._forget(url)
                    continue
                tries -= 1
                if not tries:
                    raise unreachable(url, self.url, self.peer, what, e) from None

    # --- the pool ---------------------------------------------------------------------

    def _take(self, url: str, *, reuse: bool) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection to the URL's origin (when `reuse`) or a new one; and which."""
        if reuse:
            with self._lock:
                idle = self._idle.get(origin(url))
                if idle:
                    return idle.pop(), True
        parts = urlsplit(url)
        if parts.scheme == "https":
            return http.client.HTTPSConnection(parts.netloc, timeout=self.timeout,
                                               context=self._context()), False
        return http.client.HTTPConnection(parts.netloc, timeout=self.timeout), False

    def _forget(self, url: str) -> None:
        with self._lock:
            idle = self._idle.pop(origin(url), [])
        for conn in idle:
            conn.close()

    def _give(self, url: str, conn: http.client.HTTPConnection, *, reusable: bool) -> None:
        if reusable:
            with self._lock:
                idle = self._idle.setdefault(origin(url), [])
                if len(idle) < IDLE_PER_HOST:
                    idle.append(conn)
                    return
        conn.close()

    def _context(self) -> ssl.SSLContext:
        with self._lock:
            if self._tls is None:
                self._tls = ssl.create_default_context(
                    cafile=str(self.cafile) if self.cafile else None)
            return self._tls

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

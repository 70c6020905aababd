"""A small client of the OCI distribution API (spec v1.1), enough to mirror a graft into a
registry teams already run (CNCF Distribution, Harbor, a cloud registry, `kvgraft serve`)
and back: blob HEAD, monolithic upload (POST then PUT), manifest PUT and GET, blob GET.

Credentials are answered the way the registry asks for them (`WWW-Authenticate`): Basic
with the user and secret, or the Distribution token flow (the realm is asked, with Basic
credentials when there are some, for a bearer token for the scope). Every read is bounded
by the size the caller expects and hashed on the way; a redirect (a registry that hands out
presigned storage URLs) is followed without the credentials when it leaves the registry.
Errors are typed: unreachable 7 (Unavailable), refused credentials 8 (AuthRefused), wrong
bytes 4 (IntegrityError), missing 3 (NotFound).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlencode, urljoin, urlsplit

from kvgraft.digest import Buffer, Digest
from kvgraft.errors import (
    AuthRefused,
    IntegrityError,
    NotFound,
    RegistryError,
    Unavailable,
    UsageError,
)
from kvgraft.reference import check_name, check_tag

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MAX_MANIFEST = 4 << 20  # what Distribution itself accepts
MAX_ERROR_BODY = 64 << 10
MAX_TOKEN_BODY = 64 << 10
PIECE = 1 << 20
TIMEOUT = 60.0
_REDIRECTS = 5
_SCHEMES = {"oci": "https", "https": "https", "oci+http": "http", "http": "http"}
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True, slots=True)
class OciLocation:
    """`oci://host[:port]/repository[:tag]`: a repository in an OCI registry.

    `oci://` and `https://` speak HTTPS; `oci+http://` and `http://` plain HTTP (a registry
    on loopback or behind a trusted network)."""

    scheme: str  # http or https
    netloc: str  # host[:port]
    repository: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> OciLocation:
        scheme, sep, rest = text.partition("://")
        if not sep or scheme not in _SCHEMES:
            raise UsageError(f"not an OCI registry URL: {text!r}",
                             hint="use oci://host[:port]/repository[:tag] (oci+http:// for "
                                  "plain HTTP)")
        netloc, slash, path = rest.partition("/")
        if not netloc or not slash or not path:
            raise UsageError(f"{text!r} names no repository",
                             hint="use oci://host[:port]/repository[:tag]")
        repository, colon, tag = path.partition(":")
        return cls(_SCHEMES[scheme], netloc, check_name(repository),
                   check_tag(tag) if colon else "latest")

    @property
    def registry_url(self) -> str:
        return f"{self.scheme}://{self.netloc}"

    def __str__(self) -> str:
        return f"{self.registry_url}/{self.repository}:{self.tag}"


@dataclass(frozen=True, slots=True)
class Credentials:
    username: str
    secret: str

    def basic(self) -> str:
        raw = f"{self.username}:{self.secret}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")


class _Response:
    """An answer whose body has been read (bounded) or is still to be streamed."""

    def __init__(self, resp: http.client.HTTPResponse, conn: http.client.HTTPConnection
                 ) -> None:
        self.status = resp.status
        self.headers = resp.headers
        self.raw = resp
        self.conn = conn

    def read(self, limit: int, what: str) -> bytes:
        declared = self.raw.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise IntegrityError(f"{what} is {declared} bytes, more than the {limit} expected")
        data = self.raw.read(limit + 1)
        if len(data) > limit:
            raise IntegrityError(f"{what} is longer than the {limit} bytes expected")
        return data


class OciClient:
    """One registry (scheme + host[:port]); thread-safe (a connection per thread)."""

    def __init__(self, registry_url: str, credentials: Credentials | None = None, *,
                 timeout: float = TIMEOUT) -> None:
        parts = urlsplit(registry_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError(f"not a registry URL: {registry_url!r}")
        self.url = f"{parts.scheme}://{parts.netloc}"
        self.credentials = credentials
        self.timeout = timeout
        self._local = threading.local()
        self._tokens: dict[str, str] = {}  # scope → bearer token from the realm
        self._lock = threading.Lock()

    # --- the API ----------------------------------------------------------------------

    def blob_exists(self, repository: str, digest: Digest, size: int) -> bool:
        r = self._call("HEAD", f"/v2/{repository}/blobs/{digest}", repository, "pull")
        if r.status == 404:
            self._drain(r)
            return False
        self._expect(r, (200,), f"HEAD blob {digest}")
        length = r.headers.get("Content-Length")
        # A blob of another size under that digest is not the one we would push.
        return length is None or not length.isdigit() or int(length) == size

    def put_blob(self, repository: str, digest: Digest, data: Buffer) -> None:
        """Monolithic upload: POST opens it, one PUT carries the bytes and the digest."""
        r = self._call("POST", f"/v2/{repository}/blobs/uploads/", repository, "push",
                       body=b"")
        self._expect(r, (202,), f"open an upload for {digest}")
        location = r.headers.get("Location")
        if not location:
            raise RegistryError(f"{self.url} opened an upload without a Location")
        target = urljoin(self.url + "/", location)
        sep = "&" if "?" in target else "?"
        r = self._call("PUT", f"{target}{sep}{urlencode({'digest': str(digest)})}",
                       repository, "push", body=data,
                       headers={"Content-Type": "application/octet-stream"})
        self._expect(r, (201,), f"upload of blob {digest}")

    def put_manifest(self, repository: str, tag: str, body: bytes, media_type: str) -> Digest:
        digest = Digest.of(body)
        r = self._call("PUT", f"/v2/{repository}/manifests/{tag}", repository, "push",
                       body=body, headers={"Content-Type": media_type})
        self._expect(r, (201,), f"manifest PUT of {repository}:{tag}")
        answered = r.headers.get("Docker-Content-Digest")
        if answered and answered != str(digest):
            raise IntegrityError(f"{self.url} stored the manifest of {repository}:{tag} as "
                                 f"{answered}, expected {digest}")
        return digest

    def get_manifest(self, repository: str, reference: str, accept: str = OCI_MANIFEST,
                     ) -> tuple[bytes, Digest]:
        r = self._call("GET", f"/v2/{repository}/manifests/{reference}", repository, "pull",
                       headers={"Accept": accept})
        self._expect(r, (200,), f"manifest {repository}:{reference}", consume=False)
        body = r.read(MAX_MANIFEST, f"manifest {repository}:{reference}")
        digest = Digest.of(body)
        answered = r.headers.get("Docker-Content-Digest")
        for claimed in (answered, reference if reference.startswith("sha256:") else None):
            if claimed and claimed != str(digest):
                raise IntegrityError(f"manifest {repository}:{reference} from {self.url} "
                                     f"hashes to {digest}, not {claimed}")
        return body, digest

    def get_blob(self, repository: str, digest: Digest, size: int) -> bytes:
        """The blob's bytes, exactly `size` of them, hashed while they arrive."""
        r = self._call("GET", f"/v2/{repository}/blobs/{digest}", repository, "pull")
        self._expect(r, (200,), f"blob {digest}", consume=False)
        what = f"blob {digest} from {self.url}"
        h = hashlib.sha256()
        out = bytearray()
        while len(out) <= size:
            piece = r.raw.read(min(PIECE, size + 1 - len(out)))
            if not piece:
                break
            h.update(piece)
            out += piece
        if len(out) != size:
            raise IntegrityError(f"{what} is {'longer' if len(out) > size else 'shorter'} "
                                 f"than its {size} bytes")
        digest.check(Digest.from_hasher(h), what)
        return bytes(out)

    # --- transport and credentials -----------------------------------------------------

    def _call(self, method: str, target: str, repository: str, action: str, *,
              body: Buffer | None = None, headers: Mapping[str, str] | None = None,
              ) -> _Response:
        url = target if "://" in target else self.url + target
        scope = f"repository:{repository}:{'pull,push' if action == 'push' else 'pull'}"
        hdrs = dict(headers or {})
        auth = self._authorization(scope)
        answered = False
        redirects = 0
        while True:
            send = dict(hdrs)
            if auth and _same_origin(url, self.url):
                send["Authorization"] = auth
            r = self._send(method, url, body, send)
            refused = None
            if r.status == 401 and not answered:
                answered = True  # once: a second 401 means the credentials are refused
                refused = self._message(r)  # read first: the token request reuses the line
                fresh = self._answer_challenge(r, scope)
                if fresh is not None:
                    auth = fresh
                    continue
            if r.status in (301, 302, 303, 307, 308) and method in ("GET", "HEAD"):
                location = r.headers.get("Location")
                self._drain(r)
                redirects += 1
                if not location or redirects > _REDIRECTS:
                    raise RegistryError(f"{url}: a redirect without a Location, or too many")
                url = urljoin(url, location)
                continue
            if r.status == 401:
                raise AuthRefused(f"{self.url} refused the credentials for {scope}: "
                                  f"{refused or self._message(r)}",
                                  hint="pass a token or password the registry accepts "
                                       "(--token-file)")
            if r.status == 403:
                raise AuthRefused(f"{self.url} denied {scope}: {self._message(r)}",
                                  hint="use credentials with that scope")
            return r

    def _authorization(self, scope: str) -> str | None:
        token = self._tokens.get(scope)
        return f"Bearer {token}" if token else None

    def _answer_challenge(self, r: _Response, scope: str) -> str | None:
        challenge = r.headers.get("WWW-Authenticate", "")
        kind, _, params = challenge.partition(" ")
        if kind.lower() == "basic":
            return self.credentials.basic() if self.credentials else None
        if kind.lower() != "bearer":
            return None
        fields = dict(_CHALLENGE_PARAM.findall(params))
        realm = fields.get("realm")
        if not realm:
            return None
        query = {"scope": scope, **({"service": fields["service"]} if "service" in fields
                                    else {})}
        sep = "&" if "?" in realm else "?"
        hdrs = {"Authorization": self.credentials.basic()} if self.credentials else {}
        tr = self._send("GET", f"{realm}{sep}{urlencode(query)}", None, hdrs)
        if tr.status in (401, 403):
            raise AuthRefused(f"{realm} refused the credentials for {scope}: "
                              f"{self._message(tr)}",
                              hint="pass a token or password the registry accepts "
                                   "(--token-file)")
        self._expect(tr, (200,), f"token for {scope} from {realm}", consume=False)
        try:
            doc = json.loads(tr.read(MAX_TOKEN_BODY, "token answer"))
            token = doc.get("token") or doc.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise RegistryError(f"{realm} answered no token for {scope}")
        with self._lock:
            self._tokens[scope] = token
        return f"Bearer {token}"

    def _send(self, method: str, url: str, body: Buffer | None,
              headers: Mapping[str, str]) -> _Response:
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        for attempt in (0, 1):  # a kept-alive connection the server closed: once more
            conn = self._connection(parts.scheme, parts.netloc)
            try:
                hdrs = dict(headers)
                if body is not None:
                    hdrs["Content-Length"] = str(memoryview(body).nbytes)
                conn.request(method, path, body=body, headers=hdrs)
                resp = conn.getresponse()
                return _Response(resp, conn)
            except (http.client.RemoteDisconnected, BrokenPipeError,
                    ConnectionResetError) as e:
                conn.close()
                self._forget(parts.scheme, parts.netloc)
                if attempt:
                    raise Unavailable(f"{parts.netloc} closed the connection: {e}") from None
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._forget(parts.scheme, parts.netloc)
                raise Unavailable(f"cannot reach the OCI registry at {parts.scheme}://"
                                  f"{parts.netloc}: {e}",
                                  hint="check the URL and that the registry is running") \
                    from None
        raise AssertionError("unreachable")

    def _connection(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        conns: dict[tuple[str, str], http.client.HTTPConnection] = \
            self._local.__dict__.setdefault("conns", {})
        conn = conns.get((scheme, netloc))
        if conn is None:
            cls = http.client.HTTPSConnection if scheme == "https" else \
                http.client.HTTPConnection
            conn = conns[(scheme, netloc)] = cls(netloc, timeout=self.timeout)
        return conn

    def _forget(self, scheme: str, netloc: str) -> None:
        self._local.__dict__.get("conns", {}).pop((scheme, netloc), None)

    def close(self) -> None:
        for conn in self._local.__dict__.get("conns", {}).values():
            conn.close()
        self._local.__dict__.pop("conns", None)

    @staticmethod
    def _drain(r: _Response) -> None:
        r.raw.read(MAX_ERROR_BODY)
        if not r.raw.isclosed():  # a long body we will not read: do not reuse the line
            r.conn.close()

    def _expect(self, r: _Response, ok: tuple[int, ...], what: str, *,
                consume: bool = True) -> None:
        """Raise the typed error for an answer not in `ok`; with `consume`, read the
        (small) body of a good answer so the connection can carry the next request."""
        if r.status in ok:
            if consume:
                self._drain(r)
            return
        message = self._message(r)
        if r.status == 404:
            raise NotFound(f"{what}: not in {self.url} ({message})")
        raise RegistryError(f"{what}: {self.url} answered {r.status}: {message}")

    @staticmethod
    def _message(r: _Response) -> str:
        """The OCI error body's first message (or the status line), for one error line."""
        try:
            data = r.raw.read(MAX_ERROR_BODY)
        except (OSError, http.client.HTTPException):
            data = b""
        if not r.raw.isclosed():
            r.conn.close()
        try:
            errors = json.loads(data)["errors"]
            first = errors[0]
            return f"{first.get('code', '')} {first.get('message', '')}".strip()[:300]
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return f"{r.status} {r.raw.reason}"


def _same_origin(url: str, base: str) -> bool:
    a, b = urlsplit(url), urlsplit(base)
    return (a.scheme, a.netloc) == (b.scheme, b.netloc)

"""Pulling from `kvgraft serve` over HTTP with a token: no catalog or bucket credentials.

The server resolves references and hands out each blob exactly as stored (encoded,
self-describing); the pull runs through the same Fetcher as a direct one, so every blob is
decoded and hashed against its digest before it is used, lands in the machine cache, and a
second pull transfers nothing. A transfer cut off mid-blob resumes where it stopped.
Only the standard library speaks HTTP here, so a client needs no extra.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvgraft.blobstore.base import BlobInfo, too_large
from kvgraft.cache import Cache
from kvgraft.digest import Buffer, Digest
from kvgraft.errors import AuthRefused, NotFound, RegistryError, Unavailable, UsageError
from kvgraft.manifest import Manifest
from kvgraft.presigned import Redirect, pieces, store_error
from kvgraft.pull import Fetcher, FetchStats, Progress, export, fetch
from kvgraft.reference import Reference

RESUMES = 3  # times one blob transfer is resumed after a broken connection
TIMEOUT = 60.0


def _error(e: urllib.error.HTTPError, what: str) -> RegistryError:
    try:
        message = json.loads(e.read())["errors"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        message = e.reason
    if e.code in (401, 403):
        return AuthRefused(f"{what}: {message}", hint="check the token and its scopes")
    if e.code == 404:
        return NotFound(f"{what}: {message}")
    if e.code < 500:
        return UsageError(f"{what}: {message}")
    return Unavailable(f"{what}: server answered {e.code}: {message}")


@dataclass(frozen=True)
class HttpRemote:
    url: str  # http(s)://host:port
    token: str
    cafile: Path | None = None

    @classmethod
    def with_token_file(cls, url: str, token_file: Path, cafile: Path | None = None,
                        ) -> HttpRemote:
        try:
            token = token_file.read_text().strip()
        except OSError as e:
            raise UsageError(f"cannot read token file {token_file}: {e.strerror}") from None
        return cls(url.rstrip("/"), token, cafile)

    def _context(self) -> ssl.SSLContext | None:
        if not self.url.startswith("https:"):
            return None
        return ssl.create_default_context(cafile=str(self.cafile) if self.cafile else None)

    def request(self, path: str, *, headers: dict[str, str] | None = None,
                what: str) -> Any:
        """GET `path` on the server, with the token; or a full store URL the server
        redirected to before (a resume), without it."""
        direct = "://" in path
        url = path if direct else f"{self.url}{path}"
        auth = {} if direct else {"Authorization": f"Bearer {self.token}"}
        req = urllib.request.Request(url, headers={**auth, **(headers or {})})
        redirect = Redirect()
        handlers: list[urllib.request.BaseHandler] = [redirect]
        if context := self._context():
            handlers.append(urllib.request.HTTPSHandler(context=context))
        try:
            return urllib.request.build_opener(*handlers).open(req, timeout=TIMEOUT)
        except urllib.error.HTTPError as e:
            raise (store_error(e, what) if e.url != url or direct else _error(e, what)) \
                from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if redirect.target or direct:
                where = urllib.parse.urlsplit(redirect.target or url).netloc
                raise Unavailable(f"{what}: cannot reach the blob store at {where} that the "
                                  f"server redirected to: {reason}",
                                  hint="the server's KVGRAFT_S3_PUBLIC_ENDPOINT_URL must "
                                       "name an endpoint clients reach") from None
            raise Unavailable(f"{what}: cannot reach {self.url}: {reason}") from None

    def resolve(self, ref: Reference) -> Digest:
        q = urllib.parse.urlencode({"ref": str(ref)})
        with self.request(f"/kvgraft/v1/resolve?{q}", what=f"resolve {ref}") as r:
            return Digest.parse(json.loads(r.read())["digest"])

    def manifest(self, repository: str, digest: Digest) -> Manifest:
        """The kvgraft manifest, checked against its digest (Manifest.parse does)."""
        with self.request(f"/v2/{repository}/blobs/{digest}",
                          what=f"manifest {digest}") as r:
            return Manifest.parse(r.read(), digest)

    def store(self, repository: str) -> HttpStore:
        return HttpStore(self, repository)

    def pull(self, ref: Reference | str, cache: Cache, output: Path | None = None, *,
             workers: int = 2, progress: Progress | None = None,
             ) -> tuple[Digest, FetchStats]:
        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        digest = ref.digest or self.resolve(ref)
        manifest = self.manifest(ref.name, digest)
        cache.put_manifest(digest, manifest.canonical())
        fetcher = Fetcher(self.store(ref.name), cache)
        if output is None:
            stats = fetch(manifest, fetcher, workers=workers, progress=progress)
        else:
            stats = export(manifest, fetcher, output, workers=workers, progress=progress)
        cache.put_ref(ref, digest)
        return digest, stats


class HttpStore:
    """The read side of a blob store, through a server, for one repository."""

    def __init__(self, remote: HttpRemote, repository: str) -> None:
        self.remote = remote
        self.repository = repository

    @property
    def url(self) -> str:
        return f"{self.remote.url}/{self.repository}"

    def get(self, digest: Digest, max_size: int | None = None) -> bytes:
        q = urllib.parse.urlencode({"repository": self.repository})
        path = f"/kvgraft/v1/stored/{digest}?{q}"
        parts: list[bytes] = []
        got = 0
        total: int | None = None
        location: str | None = None  # the store URL the server redirected to: resume there
        for attempt in range(RESUMES + 1):
            headers = {"Range": f"bytes={got}-"} if got else {}
            try:
                with self.remote.request(location or path, headers=headers,
                                         what=f"blob {digest}") as r:
                    if r.url != f"{self.remote.url}{path}":
                        location = r.url
                    if r.status != 206:  # the whole blob (a range not honoured: again)
                        parts.clear()
                        got = 0
                        total = int(r.headers.get("Content-Length", "-1"))
                        if max_size is not None and total > max_size:
                            raise too_large(digest, self.url, total, max_size)
                    for piece in pieces(r):
                        parts.append(piece)
                        got += len(piece)
                        if max_size is not None and got > max_size:
                            raise too_large(digest, self.url, got, max_size)
                if total is None or total < 0 or got == total:
                    return b"".join(parts)
            except Unavailable:
                # Refused or unreachable (an expired URL among them): the server hands out
                # a fresh URL for the rest.
                location = None
                if attempt == RESUMES:
                    raise
            except (OSError, http.client.HTTPException):
                if attempt == RESUMES:
                    raise
        raise Unavailable(f"blob {digest}: transfer from {self.remote.url} stayed short "
                          f"({got} of {total} bytes)")

    def open(self, digest: Digest) -> BinaryIO:
        import io

        return io.BytesIO(self.get(digest))

    def exists(self, digest: Digest) -> bool:
        try:
            self.get(digest)
        except NotFound:
            return False
        return True

    def stat(self, digest: Digest) -> BlobInfo | None:
        raise UsageError("an HTTP remote does not stat blobs")

    def put(self, digest: Digest, parts: Sequence[Buffer]) -> bool:
        raise UsageError("pushing through an HTTP remote is not supported yet")

    def replace(self, digest: Digest, parts: Sequence[Buffer]) -> None:
        raise UsageError("repairing blobs through an HTTP remote is not supported")

    def delete(self, digest: Digest) -> bool:
        raise UsageError("an HTTP remote does not delete blobs")

    def iter(self) -> Iterator[BlobInfo]:
        raise UsageError("an HTTP remote does not list blobs")

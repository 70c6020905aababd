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
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO

from kvgraft.blobstore.base import BlobInfo, too_large
from kvgraft.digest import Buffer, Digest
from kvgraft.errors import NotFound, RegistryError, Unavailable, UsageError
from kvgraft.formats.manifest import Manifest
from kvgraft.identity.model import ModelIdentity
from kvgraft.reference import Reference
from kvgraft.remote.catalog import HttpCatalog
from kvgraft.remote.transport import BearerToken, Peer, Transport, unreachable
from kvgraft.transfer.cache import MAX_MANIFEST, Cache
from kvgraft.transfer.pull import Fetcher, FetchStats, Progress, export, fetch

RESUMES = 3  # times one blob transfer is resumed after a broken connection
MAX_ANSWER = 256 << 20  # a JSON answer (a long event log, a big listing) at most
SERVER = Peer(
    name="the kvgraft server", short="the server",
    credentials_hint="check the token and its scopes",
    store_hint="an expired URL is asked for again; if this persists, check the clocks and "
               "KVGRAFT_S3_PUBLIC_ENDPOINT_URL on the server",
    store_reach_hint="the server's KVGRAFT_S3_PUBLIC_ENDPOINT_URL must name an endpoint "
                     "clients reach")


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

    @cached_property
    def transport(self) -> Transport:
        return Transport(self.url, SERVER, auth=BearerToken(self.token), cafile=self.cafile)

    def close(self) -> None:
        self.transport.close()

    def send(self, method: str, path: str, body: Any = None, *,
             data: Sequence[Buffer] | None = None, what: str, safe: bool = False) -> Any:
        """One request with a JSON body (`body`) or raw bytes (`data`); the decoded JSON
        answer. A GET or PUT (an upload) is idempotent, so a broken connection retries it;
        a POST is not retried (an untag or an attestation must not happen twice) unless it
        only reads (`safe`)."""
        headers: dict[str, str] = {}
        payload: bytes | list[Buffer] | None = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif data is not None:
            payload = list(data)  # re-iterable: a retry sends it again
            headers["Content-Type"] = "application/octet-stream"
        answer = self.transport.call(method, path, body=payload, headers=headers, what=what,
                                     limit=MAX_ANSWER, safe=safe)
        try:
            return json.loads(answer or b"null")
        except ValueError:
            raise Unavailable(f"{what}: {self.url} answered something that is not JSON",
                              hint="is the remote's URL that of a kvgraft server?") from None

    def match(self, identity: ModelIdentity, token_ids: Sequence[int],
              repositories: Sequence[str] | None = None) -> dict[str, Any] | None:
        """The server's longest cached prefix of `token_ids` for `identity`, among the
        artifacts this token may pull (in repositories matching one of the shell patterns
        `repositories`, if given): kvgraft.services.match.PrefixMatch's JSON, or None."""
        query: dict[str, Any] = {"model": identity.to_json(),
                                 "tokens": [int(t) for t in token_ids]}
        if repositories is not None:
            query["repositories"] = list(repositories)
        found = self.send("POST", "/kvgraft/v1/match", body=query, what="prefix match",
                          safe=True)["match"]
        return dict(found) if found else None

    def catalog(self) -> HttpCatalog:
        return HttpCatalog(self)

    def resolve(self, ref: Reference) -> Digest:
        return self.catalog().resolve(ref)

    def manifest(self, repository: str, digest: Digest) -> Manifest:
        """The kvgraft manifest, checked against its digest (Manifest.parse does)."""
        what = f"manifest {digest}"
        raw = self.transport.call("GET", f"/v2/{repository}/blobs/{digest}", what=what,
                                  limit=MAX_MANIFEST)
        return Manifest.parse(raw, digest)

    def store(self, repository: str) -> HttpStore:
        return HttpStore(self, repository)

    def pull(self, ref: Reference | str, cache: Cache, output: Path | None = None, *,
             workers: int | None = None, progress: Progress | None = None,
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
        path = f"/kvgraft/v1/stored/{digest}?{self._query()}"
        transport, what = self.remote.transport, f"blob {digest}"
        parts: list[bytes] = []
        got = 0
        total: int | None = None
        location: str | None = None  # the store URL the server redirected to: resume there
        for attempt in range(RESUMES + 1):
            headers = {"Range": f"bytes={got}-"} if got else {}
            try:
                with transport.request("GET", location or path, headers=headers,
                                       what=what) as r:
                    r.expect((200, 206), what)
                    if r.url != transport.url + path:
                        location = r.url
                    if r.status != 206:  # the whole blob (a range not honoured: again)
                        parts.clear()
                        got = 0
                        total = int(r.header("Content-Length") or "-1")
                        if max_size is not None and total > max_size:
                            raise too_large(digest, self.url, total, max_size)
                    for piece in r.pieces():
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
            except RegistryError:  # refused or missing (an OSError too): no resume helps
                raise
            except (OSError, http.client.HTTPException) as e:
                if attempt == RESUMES:
                    raise unreachable(location or transport.url, transport.url, SERVER,
                                      what, e) from None
        raise Unavailable(f"blob {digest}: transfer from {self.remote.url} stayed short "
                          f"({got} of {total} bytes)")

    def open(self, digest: Digest) -> BinaryIO:
        import io

        return io.BytesIO(self.get(digest))

    def _query(self, **extra: str) -> str:
        return urllib.parse.urlencode({"repository": self.repository, **extra})

    def exists(self, digest: Digest) -> bool:
        return self.stat(digest) is not None

    def stat(self, digest: Digest) -> BlobInfo | None:
        """Only blobs this repository holds (or was sent) are reported: a blob stored for
        another repository must be uploaded again, which proves its bytes are in hand."""
        try:
            info = self.remote.send("GET", f"/kvgraft/v1/blobinfo/{digest}?{self._query()}",
                                    what=f"blob {digest}")
        except NotFound:
            return None
        return BlobInfo(digest, int(info["stored_size"]), float(info["mtime"]))

    def put(self, digest: Digest, parts: Sequence[Buffer]) -> bool:
        """Upload a stored (encoded) blob; the server decodes and hashes it against `digest`
        before anyone can see it, and keeps the first good copy (True if this stored it).
        A broken connection sends the blob again (blobs are chunk-sized)."""
        from kvgraft.codecs.codec import parse_frame

        head = b""
        for p in parts:  # the frame header (at most 272 bytes) names the decoded size
            head += bytes(memoryview(p)[:272 - len(head)])
            if len(head) >= 272:
                break
        _, size, _ = parse_frame(head)
        answer = self.remote.send(
            "PUT", f"/kvgraft/v1/upload/{digest}?{self._query(size=str(size))}", data=parts,
            what=f"upload of blob {digest} to {self.repository}")
        return bool(answer["stored"])

    def replace(self, digest: Digest, parts: Sequence[Buffer]) -> None:
        # The server replaces what it holds only when that no longer verifies.
        self.put(digest, parts)

    def delete(self, digest: Digest) -> bool:
        raise UsageError("an HTTP remote does not delete blobs",
                         hint="`kvgraft gc` runs on the server's host, with a direct remote")

    def iter(self) -> Iterator[BlobInfo]:
        raise UsageError("an HTTP remote does not list raw blobs",
                         hint="`kvgraft ls` lists artifacts; listing blobs needs a direct "
                              "remote")

"""Following `kvgraft serve --redirect-blobs` to a presigned store URL: the bearer token
stays behind, errors name the store, and a body cut short keeps what arrived."""

from __future__ import annotations

import http.client
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from kvgraft.errors import NotFound, RegistryError, Unavailable


def store_error(e: urllib.error.HTTPError, what: str) -> RegistryError:
    """An error from the blob store the server redirected to (S3 answers in XML)."""
    body = e.read(4096).decode("utf-8", "replace")
    found = re.search(r"<Code>([^<]*)</Code>", body)
    said = re.search(r"<Message>([^<]*)</Message>", body)
    detail = " ".join(m.group(1) for m in (found, said) if m) or f"{e.code} {e.reason}"
    where = urllib.parse.urlsplit(e.url).netloc
    if e.code == 404:
        return NotFound(f"{what}: the blob store at {where} has no such object ({detail})")
    return Unavailable(f"{what}: the blob store at {where} refused the URL the server "
                       f"redirected to: {detail}",
                       hint="an expired URL is asked for again; if this persists, check "
                            "the clocks and KVGRAFT_S3_PUBLIC_ENDPOINT_URL on the server")


def pieces(response: Any) -> Iterator[bytes]:
    """The body as it comes; what arrived before a cut too, so a resume starts after it."""
    while True:
        try:
            piece = response.read(1 << 20)
        except http.client.IncompleteRead as e:
            if e.partial:
                yield bytes(e.partial)
            raise
        if not piece:
            return
        yield piece


class Redirect(urllib.request.HTTPRedirectHandler):
    """Follows the server's redirect to a presigned blob URL without the bearer token: the
    token is for the server alone, and S3 refuses a request that carries a signature in
    its URL and an Authorization header too. Remembers where it went, for the errors."""

    target: str | None = None

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            new.remove_header("Authorization")
            self.target = newurl
        return new

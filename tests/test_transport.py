"""The one HTTP client: kept-alive connections, what is repeated after a broken line and
what is not, redirects that leave the credentials behind, and the one map from answers to
typed errors (and, on the server, from typed errors to OCI codes)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from kvgraft.errors import (
    AuthRefused,
    Conflict,
    IntegrityError,
    InvalidName,
    NotFound,
    Unavailable,
    UsageError,
)
from kvgraft.reference import Reference
from kvgraft.remote.http import SERVER
from kvgraft.remote.transport import BearerToken, Transport, answer_error
from kvgraft.server.errors import from_registry_error


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    seen: ClassVar[list[tuple[str, str, int, str | None]]] = []  # method, path, port, auth
    drop_next = 0  # close this many connections without an answer

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        Handler.seen.append((self.command, self.path, self.client_address[1],
                             self.headers.get("Authorization")))
        if Handler.drop_next:
            Handler.drop_next -= 1
            self.close_connection = True
            return
        if self.path.startswith("/away"):
            self.send_response(307)
            self.send_header("Location", self.headers["X-Target"] + "/landed")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def origins() -> Iterator[tuple[str, str]]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    Handler.seen, Handler.drop_next = [], 0
    yield tuple(f"http://127.0.0.1:{s.server_port}" for s in servers)  # type: ignore[misc]
    for s in servers:
        s.shutdown()
        s.server_close()


def test_connections_are_kept_alive(origins: tuple[str, str]) -> None:
    t = Transport(origins[0], SERVER, auth=BearerToken("kvg_t"))
    for _ in range(3):
        assert t.call("GET", "/x", what="x", limit=100) == b'{"ok": true}'
    assert len({port for _, _, port, _ in Handler.seen}) == 1
    assert {auth for *_, auth in Handler.seen} == {"Bearer kvg_t"}


def test_a_broken_line_repeats_a_get_or_put_but_never_a_post(origins: tuple[str, str]) -> None:
    t = Transport(origins[0], SERVER)
    for method in ("GET", "PUT"):
        Handler.drop_next = 2
        assert t.call(method, "/x", body=b"data", what="x", limit=100) == b'{"ok": true}'
    Handler.seen, Handler.drop_next = [], 1
    with pytest.raises(Unavailable, match="cannot reach the kvgraft server"):
        t.call("POST", "/x", body=b"once", what="x", limit=100)
    assert [m for m, *_ in Handler.seen] == ["POST"]


def test_a_redirect_leaves_the_token_behind(origins: tuple[str, str]) -> None:
    here, store = origins
    t = Transport(here, SERVER, auth=BearerToken("kvg_secret"))
    with t.request("GET", "/away", headers={"X-Target": store}, what="blob") as r:
        assert r.expect((200,), "blob").url == f"{store}/landed"
    (_, _, _, first), (_, path, _, second) = Handler.seen
    assert first == "Bearer kvg_secret" and path == "/landed" and second is None


@pytest.mark.parametrize(("status", "body", "error", "exit_code"), [
    (401, b'{"errors": [{"code": "UNAUTHORIZED", "message": "who?"}]}', AuthRefused, 8),
    (403, b'{"errors": [{"code": "DENIED", "message": "no scope"}]}', AuthRefused, 8),
    (404, b'{"errors": [{"code": "NAME_UNKNOWN", "message": "gone"}]}', NotFound, 3),
    (400, b'{"errors": [{"code": "DIGEST_INVALID", "message": "bad"}]}', IntegrityError, 4),
    (409, b'{"errors": [{"code": "DENIED", "message": "taken"}]}', Conflict, 6),
    (400, b'{"errors": [{"code": "UNSUPPORTED", "message": "no"}]}', UsageError, 2),
    (503, b"busy", Unavailable, 7),
])
def test_one_map_from_answers_to_errors(status: int, body: bytes, error: type[Exception],
                                        exit_code: int) -> None:
    e = answer_error(status, "Reason", body, "http://h/v2/x", "http://h", SERVER, "thing")
    assert type(e) is error and e.exit_code == exit_code and e.message.startswith("thing: ")


def test_a_store_the_server_redirected_to_is_named() -> None:
    xml = b"<Error><Code>AccessDenied</Code><Message>expired</Message></Error>"
    e = answer_error(403, "Forbidden", xml, "http://s3:9000/b/k?X-Amz-Signature=1",
                     "http://h", SERVER, "blob")
    assert isinstance(e, Unavailable) and "refused the URL the server redirected to: " \
        "AccessDenied expired" in e.message and "s3:9000" in e.message
    gone = answer_error(404, "Not Found", b"", "http://s3:9000/b/k", "http://h", SERVER, "b")
    assert isinstance(gone, NotFound) and "has no such object" in gone.message


def test_the_server_picks_oci_codes_by_type_not_by_words() -> None:
    with pytest.raises(InvalidName) as bad:
        Reference.parse("Team/kv:v1")
    assert from_registry_error(bad.value).code == "NAME_INVALID"
    named = from_registry_error(UsageError("the output must name a file"))
    assert (named.status, named.code) == (400, "UNSUPPORTED")
    assert from_registry_error(NotFound("x")).code == "NAME_UNKNOWN"
    assert from_registry_error(AuthRefused("x")).status == 401

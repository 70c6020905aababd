"""Every JSON body and query parameter the server parses, fuzzed: random nesting, lone
surrogates, NUL, huge and non-finite numbers, wrong types, over-long strings. Whatever
arrives, the answer is a 4xx (or a success), never a 500, on SQLite and on PostgreSQL
(whose columns refuse what SQLite keeps). The application runs in-process (starlette's
TestClient, with server errors answered rather than raised) over a real catalog."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, text
from starlette.testclient import TestClient

from kvgraft.client import Registry
from kvgraft.config import Config
from kvgraft.server.app import create_app
from kvgraft.server.settings import ServerSettings
from tests.support.serve import kvgraft, make_token, server_env
from tests.support.synthetic import write_synthetic

REPO = "team/kv"
_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))

HOSTILE_TEXT = ["\ud800", "a\udfffb", "\x00", "x\x00y", "x" * 300, "y" * 70, "",
                "sha256:" + "0" * 64, "team/kv", "v1", "*", "../etc", "\u00b2", "1e999"]
NUMBERS = [10**30, -(10**30), 2**63, -(2**63) - 1, 2**63 - 1, 0, -1, 1.5, 1e308, 10**39]


def _scalars() -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), st.booleans(), st.sampled_from(NUMBERS),
                     st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                     st.sampled_from(HOSTILE_TEXT), st.text(max_size=20))


def _values() -> st.SearchStrategy[Any]:
    return st.recursive(_scalars(), lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=12)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@st.composite
def _body(draw: st.DrawFn, fields: dict[str, Any]) -> bytes:
    """A body for a route expecting `fields`: each either a good value, missing, or any
    JSON; sometimes a deep nest, invalid UTF-8 or not an object at all."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return _nested(draw(st.integers(60, 5000))).encode()
    if kind == 1:
        return draw(st.sampled_from([b"\xff\xfe{", b'{"a": NaN}', b'{"a": 1e999}',
                                     b'{"a": ' + b"9" * 5000 + b"}", b'"\\ud800"', b""]))
    if kind == 2:
        return json.dumps(draw(_values())).encode()
    doc: dict[str, Any] = {}
    for key, good in fields.items():
        choice = draw(st.integers(0, 3))
        if choice == 0:
            doc[key] = good
        elif choice == 1:
            doc[key] = draw(_values())
        elif choice == 2:
            doc[key] = json.loads(_nested(draw(st.integers(1, 200))))
    return json.dumps(doc).encode()  # ensure_ascii: a lone surrogate travels as \ud800


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[tuple[TestClient, dict[str, str], str]]:
    root = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    extra: dict[str, str] = {}
    schema = None
    if request.param == "postgres":
        base: str = request.getfixturevalue("postgres_server")
        schema = f"t_{uuid.uuid4().hex[:12]}"
        with create_engine(base).begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        sep = "&" if "?" in base else "?"
        extra["KVGRAFT_CATALOG_URL"] = f"{base}{sep}options=-csearch_path%3D{schema}"
    env = server_env(root / "home", **extra)
    try:
        if schema:
            kvgraft(env, "db", "upgrade")
        write_synthetic(root / "g.safetensors", tokens=64)
        digest = kvgraft(env, "push", str(root / "g.safetensors"), f"{REPO}:v1",
                         "--chunk-tokens", "32").split()[0]
        headers = {"Authorization": f"Bearer {make_token(env, 'all', 'repository:*:*')}",
                   "Content-Type": "application/json"}
        config = Config.from_env(env)
        app = create_app(lambda: Registry(config),
                         ServerSettings(upload_dir=root / "uploads", max_upload_bytes=1 << 20))
        with TestClient(app, raise_server_exceptions=False, headers=headers) as c:
            yield c, headers, digest
    finally:
        if schema:
            with create_engine(request.getfixturevalue("postgres_server")).begin() as conn:
                conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))


def _query(params: dict[str, str]) -> str:
    """A query string as a hostile client writes it: a lone surrogate percent-encoded as
    the bytes a careless encoder makes of it."""
    return urlencode(params, encoding="utf-8", errors="surrogatepass")


def _ok(status: int, what: str) -> None:
    assert status < 500, f"{what}: {status}"


def _fields(digest: str) -> dict[str, dict[str, Any]]:
    event = {"action": "pull", "outcome": "ok", "detail": {"k": "v"}}
    return {
        "/kvgraft/v1/push": {"repository": REPO, "tag": "v2", "manifest": "{}",
                             "labels": {"k": "v"}, "event": event},
        "/kvgraft/v1/tag": {"repository": REPO, "tag": "v3", "digest": digest, "event": event},
        "/kvgraft/v1/untag": {"repository": REPO, "tag": "nope"},
        "/kvgraft/v1/events": {"action": "pull", "outcome": "ok", "repository": REPO,
                               "digest": digest, "tag": "v1", "detail": {}},
        "/kvgraft/v1/attestations": {"attestation": {
            "artifact": digest, "predicate_type": "https://x", "statement": "{}",
            "envelope": None, "keyid": "k"}, "event": event},
        "/kvgraft/v1/blob-records": {"digests": [digest]},
    }


@pytest.mark.parametrize("route", ["/kvgraft/v1/push", "/kvgraft/v1/tag", "/kvgraft/v1/untag",
                                   "/kvgraft/v1/events", "/kvgraft/v1/attestations",
                                   "/kvgraft/v1/blob-records"])
def test_json_routes_never_answer_500(client: tuple[TestClient, dict[str, str], str],
                                      route: str) -> None:
    c, _, digest = client
    fields = _fields(digest)[route]

    @_SETTINGS
    @given(_body(fields))
    def run(body: bytes) -> None:
        _ok(c.post(route, content=body).status_code, f"{route} {body[:200]!r}")

    run()


def test_oci_manifest_put_never_answers_500(
        client: tuple[TestClient, dict[str, str], str]) -> None:
    c, _, digest = client
    fields = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
              "artifactType": "application/x", "config": {
                  "mediaType": "application/x", "digest": digest, "size": 2},
              "layers": [{"mediaType": "m", "digest": digest, "size": 10**30}],
              "subject": {"mediaType": "m", "digest": digest, "size": 1},
              "annotations": {"a": "b"}}

    @_SETTINGS
    @given(_body(fields), st.sampled_from(["v9", "sha256:" + "1" * 64, "x" * 200]))
    def run(body: bytes, ref: str) -> None:
        r = c.put(f"/v2/{REPO}/manifests/{ref}", content=body,
                  headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        _ok(r.status_code, f"manifest {body[:200]!r}")

    run()


def test_match_query_never_answers_500(client: tuple[TestClient, dict[str, str], str]) -> None:
    c, _, digest = client
    model = {"architecture": digest, "tokenizer": digest, "weights": None}

    @_SETTINGS
    @given(_body({"model": model, "tokens": [1, 2, 3]}))
    def run(body: bytes) -> None:
        q = body.decode("utf-8", "surrogatepass") if body.isascii() else body.decode("latin-1")
        _ok(c.get(f"/kvgraft/v1/match?{_query({'q': q})}").status_code, f"match {q[:200]!r}")
        _ok(c.post("/kvgraft/v1/match", content=body,
                   headers={"Content-Type": "application/json"}).status_code,
            f"match POST {body[:200]!r}")

    run()


QUERY_ROUTES = {
    "/kvgraft/v1/events": ["digest", "limit", "since", "action"],
    "/kvgraft/v1/tags": ["pattern"],
    "/kvgraft/v1/log": ["ref"],
    "/kvgraft/v1/resolve": ["ref"],
    "/kvgraft/v1/artifact": ["ref"],
    "/kvgraft/v1/labels": ["ref"],
    "/kvgraft/v1/models": [],
    "/kvgraft/v1/artifact-digests": [],
    f"/v2/{REPO}/tags/list": ["n", "last"],
    "/": ["q", "label", "model", "offset", "repository"],
}
PARAM_TEXT = st.one_of(st.sampled_from(HOSTILE_TEXT + [str(n) for n in NUMBERS] + [
    "9" * 5000, "²", "-5", "2026-13-45", "team/kv@sha256:" + "0" * 64, "team/kv:v1"]),
    st.text(max_size=40))


@pytest.mark.parametrize("route", sorted(QUERY_ROUTES))
def test_query_parameters_never_answer_500(client: tuple[TestClient, dict[str, str], str],
                                           route: str) -> None:
    c, _, _ = client
    names = QUERY_ROUTES[route] or ["x"]

    @_SETTINGS
    @given(st.dictionaries(st.sampled_from(names), PARAM_TEXT, max_size=len(names)))
    def run(params: dict[str, str]) -> None:
        _ok(c.get(f"{route}?{_query(params)}").status_code, f"{route} {params!r}"[:300])

    run()


def test_headers_with_numbers_never_answer_500(
        client: tuple[TestClient, dict[str, str], str]) -> None:
    c, _, digest = client

    @_SETTINGS
    @given(PARAM_TEXT.filter(lambda t: (t.isprintable() and t.isascii()) or t == "²"))
    def run(value: str) -> None:
        for path, header in [(f"/v2/{REPO}/blobs/{digest}", "range"),
                             (f"/kvgraft/v1/stored/{digest}?repository={REPO}", "range")]:
            r = c.get(path, headers={header.encode(): f"bytes={value}-".encode("latin-1")})
            _ok(r.status_code, f"{path} {header}={value!r}")
        r = c.put(f"/kvgraft/v1/upload/{digest}?{_query({'repository': REPO, 'size': value})}",
                  content=b"")
        _ok(r.status_code, f"upload size={value!r}")

    run()


"""`GET /metrics` of a real `kvgraft serve` with two workers: after a push and a pull through
an HTTP remote the counters have moved, every route label is a template, and a scrape
without the admin scope is refused unless the server was started with --metrics-public."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvgraft.blobstore.local import LocalBlobStore
from kvgraft.catalog import Catalog
from kvgraft.digest import Digest
from kvgraft.errors import Unavailable
from kvgraft.server.metrics import backend_of
from tests.support.serve import Server, kvgraft, make_token, running_server, server_env
from tests.support.synthetic import write_synthetic

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: Server, secret: str | None) -> requests.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return requests.get(f"{server.url}/metrics", headers=headers, timeout=30)


def samples(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(found: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in found.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    root = tmp_path_factory.mktemp("metrics")
    env = server_env(root / "home")
    kvgraft(env, "db", "upgrade")
    with running_server(env, root / "server.log", "--workers", "2") as srv:
        yield srv, root
        assert srv.alive()
    assert "Traceback" not in (root / "server.log").read_text()


def test_a_push_and_a_pull_move_the_counters_under_route_templates(
        served: tuple[Server, Path]) -> None:
    server, root = served
    admin = make_token(server.env, "scraper", "repository:*:admin")
    node = server_env(root / "node")
    token_file = root / "rw.token"
    token_file.write_text(make_token(server.env, "rw", "repository:team/*:pull,push") + "\n")
    kvgraft(node, "remote", "add", "hub", server.url, "--token-file", str(token_file))
    before = samples(scrape(server, admin).text)

    src = root / "graft.kv"
    write_synthetic(src, tokens=300)
    kvgraft(node, "--remote", "hub", "push", str(src), "team/kv:v1", "--chunk-tokens", "128")
    pulled = json.loads(kvgraft(node, "--remote", "hub", "--cache", str(root / "fresh"),
                                "pull", "team/kv:v1", "--json"))
    assert pulled["fetched"] > 0
    # several scrapes: with two workers each may answer, and each answer sums both
    after = [samples(scrape(server, admin).text) for _ in range(4)]

    for found in after:
        routes = {dict(ls).get("route") for (n, ls) in found if n == "kvgraft_http_requests_total"}
        assert "/kvgraft/v1/upload/{digest}" in routes
        assert "/kvgraft/v1/stored/{digest}" in routes
        assert not any("sha256:" in str(r) or "team/kv" in str(r) for r in routes), routes
        pushes = total(found, "kvgraft_http_requests_total", route="/kvgraft/v1/push",
                       method="POST", status="200")
        assert pushes == total(before, "kvgraft_http_requests_total",
                               route="/kvgraft/v1/push") + 1
        sent = total(found, "kvgraft_http_response_bytes_total",
                     route="/kvgraft/v1/stored/{digest}")
        received = total(found, "kvgraft_http_request_bytes_total",
                         route="/kvgraft/v1/upload/{digest}")
        assert sent > 0 and received >= sent  # the pull fetched what the push uploaded
        assert total(found, "kvgraft_http_request_duration_seconds_count",
                     route="/kvgraft/v1/stored/{digest}") > 0
        assert ("kvgraft_open_uploads", ()) in found


def test_a_scrape_needs_the_admin_scope(served: tuple[Server, Path]) -> None:
    server, _ = served
    admin = make_token(server.env, "scraper-2", "repository:*:admin")
    puller = make_token(server.env, "team-reader", "repository:team/*:pull")
    assert scrape(server, None).status_code == 401
    assert scrape(server, puller).status_code == 403
    assert scrape(server, "kvg_not-a-token").status_code == 401
    ok = scrape(server, admin)
    assert ok.status_code == 200 and ok.headers["Content-Type"].startswith("text/plain")
    found = samples(ok.text)
    assert total(found, "kvgraft_auth_refused_total", status="401") >= 2
    assert total(found, "kvgraft_auth_refused_total", status="403") >= 1
    assert total(found, "kvgraft_http_requests_total", route="/metrics", status="403") >= 1


def test_metrics_public_lets_anyone_scrape(tmp_path: Path) -> None:
    env = server_env(tmp_path / "home")
    kvgraft(env, "db", "upgrade")
    with running_server(env, tmp_path / "server.log", "--metrics-public") as server:
        requests.get(f"{server.url}/v2/no/such/tags/list", timeout=10)
        requests.get(f"{server.url}/v2/no/such/thing", timeout=10)
        requests.get(f"{server.url}/nothing/here", timeout=10)
        r = scrape(server, None)
        assert r.status_code == 200, r.text
        found = samples(r.text)
        assert total(found, "kvgraft_http_requests_total", route="/v2/{name}/tags/list",
                     status="401") == 1
        assert total(found, "kvgraft_http_requests_total", route="unmatched") == 2
        assert total(found, "kvgraft_http_requests_total",
                     route="/v2/{rest:path}") == 0  # the OCI routes are told apart
        assert total(found, "kvgraft_http_requests_total", route="/v2/") >= 1


def test_catalog_and_store_errors_are_told_apart(tmp_path: Path) -> None:
    not_sqlite = tmp_path / "catalog.db"
    not_sqlite.write_bytes(b"not a database")
    with pytest.raises(Unavailable) as catalog_error:
        Catalog.open(f"sqlite:///{not_sqlite}")
    (tmp_path / "file").write_text("x")
    store = LocalBlobStore(tmp_path / "file")  # a store whose directory is a file
    with pytest.raises(Unavailable) as store_error:
        store.put(Digest.of(b"x"), [b"x"])
    assert backend_of(catalog_error.value) == "catalog"
    assert backend_of(store_error.value) == "store"
    assert backend_of(Unavailable("elsewhere")) == "other"

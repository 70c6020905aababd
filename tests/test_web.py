"""The web page: listing and search, the artifact page (sizes, model, shared chunks,
lineage graph, attestations with their verification result, events), escaping and bad
input; then a real browser (Debian's Chromium driven by playwright) against a real uvicorn
server."""

from __future__ import annotations

import base64
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.testclient import TestClient

from kvgraft.catalog import Catalog
from kvgraft.catalog.browse import Search, search, shared_chunks
from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.formats.kvfile import RawTensor, write_kvfile
from kvgraft.provenance import fidelity_statement
from kvgraft.server import web
from kvgraft.server.lineage import Graph, Node, build, restrict, svg
from kvgraft.server.web import human_size, web_routes
from kvgraft.transfer.push import PushOptions
from tests.support.harness import RegistryFactory, sql_catalog, unavailable
from tests.support.synthetic import synthetic_identity, synthetic_layers
from tests.support.tampering import tamper

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"


def graft(path: Path, tokens: int, *, seed: int = 0, name: str = "synthetic") -> Path:
    """A KV file whose first `tokens` positions are the same bytes for every `tokens` with
    the same seed: grafts of one seed share their leading chunk blobs."""
    full = synthetic_layers(2, 2, 16, 1024, seed=seed)
    layers = []
    for k, v, _ in full:
        cut = [RawTensor(t.dtype, (t.shape[0], tokens, t.shape[2]),
                         np.frombuffer(t.data, np.uint16).reshape(t.shape)[:, :tokens, :]
                         .tobytes()) for t in (k, v)]
        layers.append((cut[0], cut[1], 0))
    ids = [int(t) for t in np.random.default_rng(seed + 1).integers(0, 49152, 1024)][:tokens]
    return write_kvfile(path, layers, ids, synthetic_identity(name), model_name=name,
                        model_config={"model_type": name},
                        provenance={"engine": {"name": "kvgraft.sample"}, "seed": seed})


@dataclass(frozen=True)
class World:
    registry: Registry
    base: Digest
    child: Digest
    other: Digest
    bob_signed: Digest


@pytest.fixture
def world(make_registry: RegistryFactory, catalog_url: str, tmp_path: Path) -> Iterator[World]:
    Catalog.open(catalog_url, auto_upgrade=True).close()
    store = (tmp_path / "store").as_uri()
    alice = make_registry(home=tmp_path / "alice", catalog_url=catalog_url, blob_url=store)
    bob = make_registry(home=tmp_path / "bob", catalog_url=catalog_url, blob_url=store)
    base = alice.push(graft(tmp_path / "base.kv", 600), "team/base:v1",
                      labels={"stage": "prod", "lang": "en"}).digest
    child = alice.push(graft(tmp_path / "child.kv", 900), "team/child:v1",
                       labels={"stage": "dev"},
                       options=PushOptions(parents=(base,))).digest
    other = alice.push(graft(tmp_path / "o.kv", 300, seed=7, name="othermodel"),
                       "misc/other_1:latest").digest
    alice.keyring.generate("alice")
    alice.sign("team/child:v1", "alice")
    model = alice.manifest(child).model
    alice.attest(fidelity_statement(child, model, True, details={"top1": 1.0}),
                 event_action="verify-graft")
    bob.keyring.generate("bob")
    bob.push(graft(tmp_path / "bob.kv", 256, seed=3), "bob/solo:v2")
    bob_signed = bob.sign("bob/solo:v2", "bob")[0]
    yield World(alice, base, child, other, bob_signed)
    alice.close()
    bob.close()


def client(registry: Registry) -> TestClient:
    return TestClient(Starlette(routes=web_routes(lambda: registry)))


def test_shared_chunks_and_search_queries(world: World) -> None:
    cat = sql_catalog(world.registry)
    [sharing], more = shared_chunks(cat, world.child)
    # 600 tokens in chunks of 256: the two full chunks are the same bytes in both.
    assert (sharing.digest, sharing.chunks, sharing.names, more) == (
        world.base, (0, 1), ("team/base:v1",), False)
    assert shared_chunks(cat, world.other) == ([], False)

    def found(**kw: str) -> list[str]:
        rows, _ = search(cat, Search(**kw))
        return [f"{r.repository}:{r.tag}" for r in rows]

    assert found() == ["bob/solo:v2", "misc/other_1:latest", "team/base:v1", "team/child:v1"]
    assert found(name="team") == ["team/base:v1", "team/child:v1"]
    assert found(name="team/*:v1") == ["team/base:v1", "team/child:v1"]
    assert found(name="child:v") == ["team/child:v1"]
    assert found(name="other_1") == ["misc/other_1:latest"]
    assert found(name="other%1") == found(name="team_base") == []  # wildcards are literal
    assert found(label="stage") == ["team/base:v1", "team/child:v1"]
    assert found(label="stage=prod") == ["team/base:v1"]
    assert found(label="stage=nope") == found(label="nope") == []
    assert found(model="othermodel") == ["misc/other_1:latest"]
    identity = world.registry.manifest(world.other).model.key
    assert found(model=identity.hex[:10]) == found(model=str(identity)) == [
        "misc/other_1:latest"]
    assert found(name="team", label="lang=en") == ["team/base:v1"]
    rows, more = search(cat, Search(), limit=3)
    assert len(rows) == 3 and more
    rows, more = search(cat, Search(), limit=3, offset=3)
    assert [r.repository for r in rows] == ["team/child"] and not more


def test_untagged_artifacts_are_listed(world: World) -> None:
    world.registry.untag("team/base:v1")
    rows, _ = search(sql_catalog(world.registry), Search(repository="team/base"))
    assert [(r.tag, r.digest) for r in rows] == [(None, world.base)]


def test_index_lists_and_searches(world: World) -> None:
    web = client(world.registry)
    page = web.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src" not in page.headers["content-security-policy"]
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    assert "<script" not in page.text
    for name in ("team/base", "team/child", "misc/other_1", "bob/solo"):
        assert f'data-repository="{name}"' in page.text
    assert world.base.short in page.text and "stage=prod" in page.text
    hit = web.get("/", params={"label": "stage=dev"}).text
    assert world.child.short in hit and world.base.short not in hit
    assert "1 result." in hit
    assert 'id="empty"' in web.get("/", params={"model": "no-such-model"}).text
    repo = web.get("/ui/r/team/base")
    assert repo.status_code == 200 and world.base.short in repo.text
    assert world.child.short not in repo.text


def test_index_pages(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web, "PAGE_SIZE", 3)
    client_ = client(world.registry)
    first = client_.get("/", params={"label": ""})
    assert first.text.count('class="repository"') == 3
    nxt = re.search(r'id="next-page" href="([^"]+)"', first.text)
    assert nxt is not None and nxt.group(1) == "?offset=3"
    second = client_.get("/" + nxt.group(1))
    assert second.text.count('class="repository"') == 1 and "next-page" not in second.text
    assert 'data-repository="team/child"' in second.text


def test_artifact_page_shows_everything(world: World) -> None:
    web = client(world.registry)
    record = world.registry.catalog.artifact(world.child)
    m = world.registry.manifest(world.child)
    page = web.get(f"/ui/a/{world.child}")
    assert page.status_code == 200
    text = page.text
    assert f'id="token-count">{m.token_count:,} in 4 chunks of 256' in text
    assert f"({record.size:,} bytes)" in text and f"({record.stored_size:,} bytes" in text
    for d in (m.model.key, m.model.architecture, m.model.tokenizer, m.file_digest):
        assert str(d) in text
    # Lineage: the parent is a node of the graph, linked to its page.
    svg = text[text.index("<svg"):text.index("</svg>")]
    assert f'<a href="http://testserver/ui/a/{world.base}"><g class="node parent"' in svg
    assert "team/base:v1" in svg and 'class="node current"' in svg
    assert "1 parent, 0 children" in text
    # Shared chunks: the base holds the blobs of chunks 0 and 1.
    assert f'<tr class="shared" data-digest="{world.base}">' in text
    assert "2 of 4" in text and 'style="left: 0.000%; width: 50.000%"' in text
    # The signature verifies against this server's (alice's) trust store.
    assert text.count('class="attestation" data-verdict="verified"') == 1
    assert text.count('class="attestation" data-verdict="unsigned"') == 1
    assert f"fidelity check passed on model {m.model.key.short}" in text
    assert "provenance of this graft" in text
    assert "signature verified" in text and "by alice" in text
    assert 'data-action="sign"' in text and 'data-action="push"' in text
    assert "kvgraft.sample" in text  # provenance from the KV file
    parent = web.get(f"/ui/a/{world.base}").text
    assert "0 parents, 1 child" in parent
    assert f'<a href="http://testserver/ui/a/{world.child}"><g class="node child"' in parent
    assert 'id="no-attestations"' in parent


def test_untrusted_signature_is_shown_failed(world: World) -> None:
    page = client(world.registry).get(f"/ui/a/{world.bob_signed}").text
    assert 'data-verdict="failed"' in page and "signature verified" not in page
    assert "not trusted" in page


def test_everything_is_escaped(world: World, tmp_path: Path) -> None:
    evil = "<script>alert(1)</script>"
    world.registry.push(graft(tmp_path / "e.kv", 100, seed=5, name=evil), "x/evil",
                        labels={evil: f'"{evil}'})
    web = client(world.registry)
    for page in (web.get("/").text, web.get("/", params={"q": evil}).text,
                 web.get(f"/ui/a/{world.registry.resolve('x/evil')}").text):
        assert evil not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_bad_input_gets_an_error_page(world: World) -> None:
    web = client(world.registry)
    cases = {
        "/ui/a/not-a-digest": 400,
        f"/ui/a/sha256:{'0' * 64}": 404,
        "/ui/r/Team/Base": 400,
        "/ui/r/team/..%2Fetc": 400,
        "/ui/ref/team/nothing:v1": 404,
        "/ui/ref/BAD REF": 400,
        "/?offset=x": 400,
        f"/?q={'a' * 600}": 400,
    }
    for url, status in cases.items():
        page = web.get(url, follow_redirects=False)
        assert page.status_code == status, url
        assert 'id="error"' in page.text, url
    moved = web.get("/ui/ref/team/base:v1", follow_redirects=False)
    assert moved.status_code == 302
    assert moved.headers["location"] == f"http://testserver/ui/a/{world.base}"
    assert "0" * 64 + " is not in the catalog</div>" in web.get(f"/ui/a/sha256:{'0' * 64}").text
    assert web.post("/").status_code == 405


def scoped(request: Request) -> Callable[[str], bool]:
    """Access as a server grants it: anonymous callers read the public misc/*, the token
    `team` reads team/* too, the token `child` only team/child; others are refused."""
    header = request.headers.get("authorization")
    if header is None:
        return lambda repo: repo.startswith("misc/")
    scheme, _, value = header.partition(" ")
    token = base64.b64decode(value).decode().partition(":")[2] if scheme == "Basic" else ""
    if token == "team":
        return lambda repo: repo.startswith(("team/", "misc/"))
    if token == "child":
        return lambda repo: repo == "team/child"
    raise PermissionError("unknown or revoked token")


def test_pages_show_only_what_the_viewer_may_read(world: World) -> None:
    web = TestClient(Starlette(routes=web_routes(lambda: world.registry, access=scoped)))
    team, child = ("anyone", "team"), ("anyone", "child")
    anonymous = web.get("/")
    assert anonymous.status_code == 200 and "misc/other_1" in anonymous.text
    assert "team/" not in anonymous.text and "bob/" not in anonymous.text
    assert "Sign in" in anonymous.text
    assert "team/" not in web.get("/", params={"label": "stage"}).text
    # Anonymous: a challenge, whether the repository exists or not.
    for url in ("/ui/r/team/base", "/ui/r/team/none", f"/ui/a/{world.child}",
                "/ui/ref/team/base:v1", "/ui/login"):
        page = web.get(url, follow_redirects=False)
        assert page.status_code == 401, url
        assert page.headers["www-authenticate"].startswith("Basic realm="), url
        assert "team/base:v1" not in page.text
    assert web.get("/ui/r/misc/none").status_code == 404
    assert web.get("/ui/login", auth=team, follow_redirects=False).status_code == 303
    refused = web.get(f"/ui/a/{world.child}", auth=("anyone", "stolen"))
    assert refused.status_code == 401 and "unknown or revoked token" in refused.text
    full = web.get(f"/ui/a/{world.child}", auth=team)
    assert full.status_code == 200 and "team/base:v1" in full.text
    assert "Sign in" not in full.text
    # Only team/child: its parent is an anonymous node; the chunks it shares are not said.
    narrow = web.get(f"/ui/a/{world.child}", auth=child)
    assert narrow.status_code == 200 and "team/base" not in narrow.text
    assert f'<g class="node parent hidden" data-digest="{world.base}">' in narrow.text
    assert f'href="http://testserver/ui/a/{world.base}"><g' not in narrow.text
    assert 'class="shared"' not in narrow.text and "signature verified" in narrow.text
    # With credentials, what may not be read is not found, like what does not exist.
    for url in (f"/ui/a/{world.base}", "/ui/r/team/base", "/ui/ref/team/base:v1"):
        assert web.get(url, auth=child).status_code == 404, url
    assert web.get("/", auth=child).text.count('class="repository"') == 1


def test_corrupt_manifest_is_refused_not_shown(world: World) -> None:
    tamper(sql_catalog(world.registry), "UPDATE artifacts SET manifest = :m WHERE digest = :d",
           m='{"schemaVersion": 1}', d=str(world.other))
    web = client(world.registry)
    page = web.get(f"/ui/a/{world.other}")
    assert page.status_code == 500 and 'id="error"' in page.text
    assert web.get("/").status_code == 200  # the rest still serves


def test_lineage_walk_is_bounded(world: World, tmp_path: Path) -> None:
    reg, parent = world.registry, world.child
    for i in range(4):
        parent = reg.push(graft(tmp_path / f"g{i}.kv", 950 + i), f"team/gen{i}",
                          options=PushOptions(parents=(parent,))).digest
    full = build(sql_catalog(reg), world.base, ())
    assert not full.truncated and len(full.nodes) == 6
    assert sorted(n.level for n in full.nodes) == [0, 1, 2, 3, 4, 5]
    cut = build(sql_catalog(reg), parent, reg.manifest(parent).parents, max_nodes=3)
    assert cut.truncated and len(cut.nodes) == 3
    assert build(sql_catalog(reg), world.base, (), max_depth=2).truncated


def test_lineage_that_joins_itself_points_right(world: World, tmp_path: Path) -> None:
    reg = world.registry
    both = reg.push(graft(tmp_path / "j.kv", 1000), "team/joined",
                    options=PushOptions(parents=(world.base, world.child))).digest
    graph = build(sql_catalog(reg), both, reg.manifest(both).parents)
    levels = {n.digest: n.level for n in graph.nodes}
    assert levels == {world.base: -2, world.child: -1, both: 0}
    assert set(graph.edges) == {(world.base, world.child), (world.base, both),
                                (world.child, both)}
    assert all(levels[p] < levels[c] for p, c in graph.edges)


def test_restrict_drops_what_is_reachable_only_through_hidden_grafts() -> None:
    a, root, hid, grand, pub = (Digest.of(x) for x in (b"a", b"r", b"h", b"g", b"p"))
    graph = Graph(root, (Node(a, -1, ("secret/a:v1",), True), Node(root, 0, ("pub/r",), True),
                         Node(hid, 1, ("secret/h",), True), Node(grand, 2, ("pub/g",), True),
                         Node(pub, 1, ("pub/p:v2", "secret/p:v1"), True)),
                  ((a, root), (root, hid), (hid, grand), (root, pub)), False)
    seen = restrict(graph, lambda repo: repo.startswith("pub/"))
    assert {n.digest: (n.names, n.hidden) for n in seen.nodes} == {
        a: ((), True), root: (("pub/r",), False), pub: (("pub/p:v2",), False)}
    assert set(seen.edges) == {(a, root), (root, pub)}
    assert "secret" not in str(svg(seen, lambda d: f"/ui/a/{d}"))


def test_svg_marks_missing_parents_and_escapes() -> None:
    root, gone, kid = (Digest.of(x) for x in (b"root", b"gone", b"kid"))
    graph = Graph(root, (Node(root, 0, ("a/b:<v>",), True), Node(gone, -1, (), False),
                         Node(kid, 1, ('k"id',), True)), ((gone, root), (root, kid)), False)
    out = str(svg(graph, lambda d: f"/ui/a/{d}?x=<&>"))
    assert "<v>" not in out and "a/b:&lt;v&gt;" in out and "k&#34;id" in out
    assert f'<g class="node parent missing" data-digest="{gone}">' in out
    assert f'href="/ui/a/{gone}' not in out and "not in catalog" in out  # links nowhere
    assert f'<a href="/ui/a/{kid}?x=&lt;&amp;&gt;"><g class="node child"' in out
    assert out.count('class="edge"') == 2


def test_human_size() -> None:
    assert [human_size(n) for n in (None, 0, 1023, 1024, 5 * 2**20, 3 * 2**50)] == [
        "—", "0 B", "1023 B", "1.0 KiB", "5.0 MiB", "3072.0 TiB"]


# --- a real browser against a real server ------------------------------------------------


@pytest.fixture
def served(world: World) -> Iterator[str]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = Starlette(routes=web_routes(lambda: world.registry))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=20)
    sock.close()


@pytest.mark.parametrize("catalog_url", ["sqlite"], indirect=True)
def test_browser_shows_lineage_and_signature(world: World, served: str) -> None:
    if not Path(CHROMIUM).exists():
        unavailable(f"Chromium at {CHROMIUM} (Debian package chromium)")
    from playwright.sync_api import sync_playwright

    shots = ROOT / ".artifacts" / "web"
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(served, wait_until="load")
            assert page.locator("section.repository").count() == 4
            # Search by label through the form, as a person would.
            page.get_by_label("label").fill("stage=dev")
            page.get_by_role("button", name="Search").click()
            page.wait_for_url(re.compile(r"label=stage%3Ddev"))
            assert page.locator("section.repository").count() == 1
            page.screenshot(path=str(shots / "search.png"), full_page=True)
            page.get_by_role("link", name="v1").click()
            page.wait_for_url(re.compile(rf"/ui/a/{re.escape(str(world.child))}$"))
            assert page.locator("#digest").inner_text() == str(world.child)
            graph = page.locator("#lineage svg.lineage")
            assert graph.is_visible()
            parent = graph.locator(f'g.node.parent[data-digest="{world.base}"]')
            assert parent.is_visible() and "team/base:v1" in (parent.text_content() or "")
            assert graph.locator("g.node.current").count() == 1
            status = page.locator('tr.attestation[data-verdict="verified"] .status')
            assert status.inner_text() == "signature verified"
            assert status.evaluate("e => getComputedStyle(e).color") == "rgb(26, 127, 55)"
            # Chunks 0-1 of 4 shared: one run, half the strip (styles survive the policy).
            [run] = page.locator("tr.shared .strip span").all()
            box, strip = run.bounding_box(), page.locator("tr.shared .strip").bounding_box()
            assert box is not None and strip is not None
            assert abs(box["width"] - (strip["width"] - 2) / 2) < 2
            page.screenshot(path=str(shots / "artifact.png"), full_page=True)
            # Follow the lineage: the parent's node opens the parent's page.
            parent.click()
            page.wait_for_url(re.compile(rf"/ui/a/{re.escape(str(world.base))}$"))
            assert page.locator(f'#lineage g.node.child[data-digest="{world.child}"]').count() == 1
            page.screenshot(path=str(shots / "parent.png"), full_page=True)
        finally:
            browser.close()
    assert (shots / "artifact.png").stat().st_size > 10_000

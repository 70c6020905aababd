"""Tenants that share a `kvgraft serve` and its store but not trust, against a real server
on SQLite and on PostgreSQL: what one learns of or does to another's artifacts through
content both hold, and inputs each database must refuse the same way (docs/security.md)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from tests.support.serve import Server, catalog_env, kvgraft, make_token, running_server
from tests.support.serve import server_env as node_env
from tests.support.synthetic import write_synthetic

V1 = "/kvgraft/v1"
IDS = list(range(1000, 1096))  # the shared graft's tokens; team/short holds the first 64


@dataclass(frozen=True)
class World:
    server: Server
    tokens: dict[str, str]  # a: team/*, b: other/*, admin: everything
    nodes: dict[str, dict[str, str]]  # a kvgraft home per tenant, remote "hub"
    graft: Path  # content both tenants push
    shared: str  # its digest, pushed first by b into other/secret:q4
    root: Path

    def get(self, who: str | None, path: str, **params: Any) -> requests.Response:
        return requests.get(f"{self.server.url}{path}", params=params,
                            headers=_auth(self.tokens.get(who or "")), timeout=30)

    def post(self, who: str | None, path: str, body: Any, **headers: str,
             ) -> requests.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return requests.post(f"{self.server.url}{path}", data=data, timeout=30,
                             headers={"Content-Type": "application/json",
                                      **_auth(self.tokens.get(who or "")), **headers})

    def cli(self, who: str, *args: str) -> str:
        return kvgraft(self.nodes[who], "--remote", "hub", *args)


def _auth(secret: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"} if secret else {}


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[World]:
    root = tmp_path_factory.mktemp(f"tenancy-{request.param}")
    with catalog_env(request, root / "server") as env:
        tokens = {"a": make_token(env, "a", "repository:team/*:pull,push,delete"),
                  "b": make_token(env, "b", "repository:other/*:pull,push"),
                  "admin": make_token(env, "root", "repository:*:admin")}
        with running_server(env, root / "server.log", "--public", "open/*") as server:
            nodes = {}
            for who in ("a", "b"):
                nodes[who] = node_env(root / f"node-{who}")
                (root / f"{who}.token").write_text(tokens[who] + "\n")
                kvgraft(nodes[who], "remote", "add", "hub", server.url, "--token-file",
                        str(root / f"{who}.token"))
            graft = root / "shared.safetensors"
            write_synthetic(graft, token_ids=IDS)
            shared = json.loads(kvgraft(nodes["b"], "--remote", "hub", "push", str(graft),
                                        "other/secret:q4", "--chunk-tokens", "32", "--json",
                                        "--label", "owner=other"))["digest"]
            yield World(server, tokens, nodes, graft, shared, root)
            assert server.alive()
        assert "Traceback" not in (root / "server.log").read_text()


def _code(r: requests.Response) -> str:
    return str(r.json()["errors"][0]["code"])


# --- inputs both databases refuse alike ------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    (f"{V1}/events", {"action": "pull", "outcome": "o" * 33, "repository": "team/x"}),
    (f"{V1}/events", {"action": "pull", "repository": "team/x", "tag": "t" * 129}),
    (f"{V1}/events", {"action": "pull\u0000", "repository": "team/x"}),
    (f"{V1}/events", {"action": "pull", "repository": "team/x", "detail": {"k": "\udc80"}}),
    (f"{V1}/events", {"action": "pull", "repository": "team/x", "detail": {"n": 10**30}}),
    (f"{V1}/tag", {"repository": "team/x", "tag": "t" * 129, "digest": "sha256:" + "0" * 64}),
    (f"{V1}/tag", {"repository": "team/x", "tag": 7, "digest": "sha256:" + "0" * 64}),
    (f"{V1}/push", {"repository": "team/x", "manifest": "{\udc80}"}),
    (f"{V1}/push", "[" * 100_000 + "]" * 100_000),
    (f"{V1}/blob-records", '{"digests": ' + "[" * 5000 + "]" * 5000 + "}"),
])
def test_bad_json_is_a_400_on_both_databases(world: World, path: str, body: Any) -> None:
    r = world.post("a", path, body)
    assert r.status_code == 400, (r.status_code, r.text[:300])


def test_column_limits_hold_at_their_edge(world: World) -> None:
    """What fits the columns is stored on both databases; one more character is a 400."""
    ok = world.post("a", f"{V1}/events", {"action": "a" * 64, "outcome": "o" * 32,
                                          "repository": "team/x", "tag": "t" * 128})
    assert ok.status_code == 200, ok.text
    r = world.post("a", f"{V1}/events", {"action": "a" * 65, "repository": "team/x"})
    assert r.status_code == 400


def test_oci_manifest_media_type_and_nesting_are_refused(world: World) -> None:
    def put(doc: Any) -> requests.Response:
        return requests.put(f"{world.server.url}/v2/team/x/manifests/v1", data=doc,
                            headers={**_auth(world.tokens["a"]), "Content-Type":
                                     "application/vnd.oci.image.manifest.v1+json"}, timeout=30)

    long_type = json.dumps({"schemaVersion": 2, "mediaType": "application/" + "x" * 250,
                            "config": {}, "layers": []})
    assert put(long_type).status_code == 400
    assert put('{"schemaVersion": 2, "annotations": ' + "[" * 10_000 + "]" * 10_000 + "}",
               ).status_code == 400
    assert put('{"schemaVersion": 2, "mediaType": "\\ud800"}').status_code == 400


def test_match_and_events_queries_with_wrong_types_are_400(world: World) -> None:
    model = {"architecture": world.shared, "tokenizer": world.shared}
    for q in [{"model": "x", "tokens": [1]}, {"model": model, "tokens": [10**30]},
              {"model": model, "tokens": "abc"}, [1, 2], {"model": model, "tokens": [True]}]:
        r = world.get("a", f"{V1}/match", q=json.dumps(q))
        assert r.status_code == 400, (q, r.status_code, r.text[:200])
    for limit in [str(10**30), "²", "-1", "1e3"]:
        r = world.get("admin", f"{V1}/events", limit=limit)
        assert r.status_code == 400, (limit, r.status_code)
    assert world.get("admin", f"{V1}/tags", pattern="team/\x00").status_code == 400


# --- what a tenant learns through content another holds ---------------------------------


def _events(r: requests.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    return list(r.json()["events"])


def test_log_by_digest_only_through_a_repository_that_holds_it(world: World) -> None:
    hidden = world.get("a", f"{V1}/log", ref=f"team/anything@{world.shared}")
    unknown = world.get("a", f"{V1}/log", ref="team/anything@sha256:" + "5" * 64)
    assert hidden.status_code == unknown.status_code == 404
    assert _code(hidden) == _code(unknown)
    assert hidden.json()["errors"][0]["message"].replace(world.shared, "D") == \
        unknown.json()["errors"][0]["message"].replace("sha256:" + "5" * 64, "D")
    world.cli("a", "push", str(world.graft), "team/logged:v1", "--chunk-tokens", "32")
    mine = _events(world.get("a", f"{V1}/log", ref=f"team/logged@{world.shared}"))
    assert mine and all(e["repository"].startswith("team/") for e in mine)
    assert all(e["actor"] != "token:b" for e in mine)
    by_digest = _events(world.get("a", f"{V1}/events", digest=world.shared))
    assert by_digest and all(e["repository"].startswith("team/") for e in by_digest)
    theirs = world.get("admin", f"{V1}/log", ref=f"other/secret@{world.shared}")
    assert any(e["repository"] == "other/secret" for e in _events(theirs))


def _push_json(world: World, who: str, path: Path, ref: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(world.cli(who, "push", str(path), ref, "--chunk-tokens",
                                               "32", "--json"))
    return out


def test_pushing_content_another_tenant_holds_reveals_nothing(world: World) -> None:
    """The answer to a push of bytes another tenant already stored is the answer to a
    first push: blobs stored, artifact created."""
    fresh = world.root / "fresh.safetensors"
    write_synthetic(fresh, token_ids=IDS, seed=7, name="fresh")
    first = _push_json(world, "b", fresh, "other/fresh:v1")
    again = _push_json(world, "a", fresh, "team/fresh:v1")
    assert first["blobs_stored"] > 0 and first["created"]
    for key in ("blobs_stored", "bytes_stored", "created", "stored_size"):
        assert again[key] == first[key], (key, first, again)


def _model_of(world: World, who: str, ref: str) -> dict[str, Any]:
    info = world.get(who, f"{V1}/artifact", ref=ref).json()
    return {k: info["model"][k] for k in ("architecture", "tokenizer", "weights")}


def test_match_searches_only_readable_repositories(world: World) -> None:
    ids = list(range(5000, 5096))
    longer, short = world.root / "long.safetensors", world.root / "short.safetensors"
    write_synthetic(longer, token_ids=ids, seed=2)
    write_synthetic(short, token_ids=ids[:64], seed=3)
    theirs = _push_json(world, "b", longer, "other/long:v1")["digest"]
    mine = _push_json(world, "a", short, "team/short:v1")["digest"]
    q = json.dumps({"model": _model_of(world, "a", "team/short:v1"), "tokens": ids})
    # b's 96-token graft is longer; it neither answers a nor hides a's own 64 tokens.
    found = world.get("a", f"{V1}/match", q=q).json()["match"]
    assert found is not None and found["digest"] == mine and found["length"] == 64
    assert found["references"] == ["team/short:v1"]
    other = world.get("b", f"{V1}/match", q=q).json()["match"]
    assert other["digest"] == theirs and other["length"] == 96
    assert other["references"] == ["other/long:v1"]
    # A guessed sequence only b holds: the same answer as one nobody holds.
    guess = json.dumps({"model": _model_of(world, "a", "team/short:v1"),
                        "tokens": [*ids[:64], 1, 2, 3]})
    nobody = json.dumps({"model": _model_of(world, "a", "team/short:v1"), "tokens": [7, 8]})
    assert world.get("a", f"{V1}/match", q=guess).json()["match"]["length"] == 64
    assert world.get("a", f"{V1}/match", q=nobody).json() == {"match": None}
    # narrowed further by the caller (a connector's restore_from): the lookup itself
    model = _model_of(world, "a", "team/short:v1")
    for patterns, expect in ((["team/sh*"], mine), (["team/none"], None),
                             (["other/*"], None)):  # never beyond what the token reads
        q = json.dumps({"model": model, "tokens": ids, "repositories": patterns})
        found = world.get("a", f"{V1}/match", q=q).json()["match"]
        assert (found and found["digest"]) == expect, patterns
    bad = json.dumps({"model": model, "tokens": ids, "repositories": "team/*"})
    assert world.get("a", f"{V1}/match", q=bad).status_code == 400


def test_match_of_a_32k_token_prompt_is_a_bounded_post(world: World) -> None:
    """A prompt as long as vLLM serves: the query travels as a POST body (a URL holds
    ~7,500 tokens), through the client the connector uses; the body stays bounded."""
    from kvgraft.identity.model import ModelIdentity
    from kvgraft.remote.http import HttpRemote

    ids = [int(t) for t in np.random.default_rng(32).integers(0, 49152, 32768)]
    long = world.root / "long-32k.safetensors"
    write_synthetic(long, num_layers=1, kv_heads=1, head_dim=8, token_ids=ids, seed=32)
    digest = json.loads(world.cli("a", "push", str(long), "team/long32k:v1",
                                  "--json"))["digest"]
    model = _model_of(world, "a", "team/long32k:v1")
    remote = HttpRemote(world.server.url, world.tokens["a"])
    try:
        found = remote.match(ModelIdentity.from_json(model), [*ids, 7, 8])
        assert found is not None and found["digest"] == digest and found["length"] == 32768
        scoped = remote.match(ModelIdentity.from_json(model), ids, ["other/*"])
        assert scoped is None  # the scope still narrows a POSTed query
    finally:
        remote.close()
    # what the POST replaces: the same query in a URL is refused before it is read
    q = json.dumps({"model": model, "tokens": ids})
    assert world.get("a", f"{V1}/match", q=q).status_code in (400, 414, 431)
    r = world.post("a", f"{V1}/match", {"model": model, "tokens": ids[:5000]})
    assert r.status_code == 200 and r.json()["match"]["length"] == 5000
    r = world.post("a", f"{V1}/match", {"model": model, "tokens": ids},
                   **{"Content-Type": "text/plain"})
    assert r.status_code == 415  # a cross-site form cannot send it
    for bad in ({"model": model, "tokens": [1.5]}, {"model": model}, [1, 2],
                {"model": model, "tokens": ids, "repositories": "team/*"}):
        assert world.post("a", f"{V1}/match", bad).status_code == 400, bad


def test_match_names_only_readable_references(world: World) -> None:
    world.cli("a", "push", str(world.graft), "team/named:v1", "--chunk-tokens", "32")
    q = json.dumps({"model": _model_of(world, "a", "team/named:v1"), "tokens": IDS})
    found = world.get("a", f"{V1}/match", q=q).json()["match"]
    assert found["digest"] == world.shared and found["length"] == 96
    assert found["references"] and all(r.startswith("team/") for r in found["references"])


def test_models_lists_models_of_readable_repositories(world: World) -> None:
    private = world.root / "private.safetensors"
    write_synthetic(private, tokens=16, name="board-minutes-model")
    world.cli("b", "push", str(private), "other/private:v1", "--chunk-tokens", "16")

    def names(who: str) -> set[str]:
        r = world.get(who, f"{V1}/models")
        assert r.status_code == 200, r.text
        return {m["name"] for m in r.json()["models"]}

    assert "board-minutes-model" in names("b") and "board-minutes-model" in names("admin")
    assert "board-minutes-model" not in names("a")


def test_a_pattern_matching_the_name_star_is_not_admin(world: World) -> None:
    for i, pattern in enumerate(("?", "*?", "?*")):
        secret = make_token(world.server.env, f"star{i}", f"repository:{pattern}:admin")
        world.tokens[f"p:{pattern}"] = secret
        assert world.get(f"p:{pattern}", f"{V1}/events").status_code == 403, pattern
        assert world.get(f"p:{pattern}", f"{V1}/log").status_code == 403, pattern
    assert world.get("admin", f"{V1}/events").status_code == 200


# --- attestations and events count only where the reader trusts them -------------------


def _pull_verified(world: World, who: str, ref: str) -> int:
    r = subprocess.run([sys.executable, "-m", "kvgraft.cli", "--remote", "hub", "pull", ref,
                        "-o", str(world.root / f"{who}-out.safetensors"), "--require-verified"],
                       env=world.nodes[who], capture_output=True, text=True, timeout=120)
    return r.returncode


def test_another_tenants_attestation_does_not_satisfy_require_verified(world: World) -> None:
    from kvgraft.digest import Digest
    from kvgraft.identity.model import ModelIdentity
    from kvgraft.provenance.statement import FIDELITY, fidelity_statement

    assert _pull_verified(world, "b", "other/secret:q4") == 4
    world.cli("a", "push", str(world.graft), "team/forge:v1", "--chunk-tokens", "32")
    model = ModelIdentity.from_json(_model_of(world, "a", "team/forge:v1"))
    statement = fidelity_statement(Digest.parse(world.shared), model, True)
    posted = world.post("a", f"{V1}/attestations", {
        "attestation": {"artifact": world.shared, "predicate_type": FIDELITY,
                        "statement": statement.canonical().decode(), "envelope": None,
                        "keyid": None},
        "event": {"action": "attest", "repository": "team/forge"}})
    assert posted.status_code == 200, posted.text
    # A plain event cannot carry an attestation's anchor, whatever repository it names.
    forged = world.post("a", f"{V1}/events", {
        "action": "verify", "repository": "team/forge", "digest": world.shared,
        "detail": {"statement_digest": str(statement.digest)}})
    assert forged.status_code == 400
    assert _pull_verified(world, "b", "other/secret:q4") == 4
    seen = world.get("b", f"{V1}/attestations/{world.shared}").json()
    assert seen["attestations"] == [] and seen["recorded"] == {}
    # In its own repository the statement counts for its author.
    assert _pull_verified(world, "a", "team/forge:v1") == 0


def test_anonymous_clients_cannot_append_events(world: World) -> None:
    public = world.root / "public.safetensors"
    write_synthetic(public, tokens=16, seed=11)
    digest = kvgraft(world.server.env, "push", str(public), "open/pub:v1",
                     "--chunk-tokens", "16").split()[0]
    assert world.get(None, f"{V1}/resolve", ref="open/pub:v1").status_code == 200
    for body in [{"action": "pull", "repository": "open/pub"},
                 {"action": "pull", "repository": "open/pub", "digest": digest},
                 {"action": "pull", "digest": digest}]:
        r = world.post(None, f"{V1}/events", body)
        assert r.status_code == 401, (body, r.status_code, r.text)
    assert world.post("a", f"{V1}/events", {"action": "pull", "repository": "team/x"},
                      ).status_code == 200


def test_labels_belong_to_the_repository_not_the_shared_bytes(world: World) -> None:
    world.cli("a", "push", str(world.graft), "team/labelled:v1", "--chunk-tokens", "32",
              "--label", "owner=team", "--label", "approved=no")
    theirs = world.get("b", f"{V1}/labels", ref="other/secret:q4").json()["labels"]
    mine = world.get("a", f"{V1}/labels", ref="team/labelled:v1").json()["labels"]
    assert theirs == {"owner": "other"}
    assert mine == {"owner": "team", "approved": "no"}
    inspected = json.loads(world.cli("b", "inspect", "other/secret:q4", "--json"))
    assert inspected["labels"] == {"owner": "other"}
    record = world.get("a", f"{V1}/record/{world.shared}").json()["artifact"]
    assert all(r.startswith("team/") for r in record["repository_labels"])
    assert record["labels"].get("owner") != "other"


# --- the web page ------------------------------------------------------------------------


def test_web_page_answers_hidden_and_missing_alike(world: World) -> None:
    hidden_src = world.root / "hidden.safetensors"
    write_synthetic(hidden_src, tokens=16, seed=21)
    hidden = _push_json(world, "b", hidden_src, "other/hidden:v1")["digest"]
    missing = "sha256:" + "6" * 64
    for who in (None, "a"):
        seen = world.get(who, f"/ui/a/{hidden}")
        absent = world.get(who, f"/ui/a/{missing}")
        assert seen.status_code == absent.status_code == (401 if who is None else 404)
        assert seen.text.replace(hidden, "D") == absent.text.replace(missing, "D")


def test_web_page_shows_no_other_tenants_pusher_labels_or_attestations(world: World) -> None:
    world.cli("a", "push", str(world.graft), "team/page:v1", "--chunk-tokens", "32")
    page = world.get("a", f"/ui/a/{world.shared}")
    assert page.status_code == 200
    assert "token:b" not in page.text and "other/" not in page.text
    assert "owner=other" not in page.text
    assert "token:a" in page.text  # the first push the viewer may see is its own
    theirs = world.get("b", f"/ui/a/{world.shared}")
    assert "token:a" not in theirs.text and "team/" not in theirs.text


def test_json_writes_need_json_and_no_foreign_origin(world: World) -> None:
    world.cli("a", "push", str(world.graft), "team/csrf:v1", "--chunk-tokens", "32")
    body = {"repository": "team/csrf", "tag": "forged", "digest": world.shared}
    basic = {"Authorization": "Basic " + base64.b64encode(
        f"x:{world.tokens['a']}".encode()).decode()}
    form = requests.post(f"{world.server.url}{V1}/tag", data=json.dumps(body), timeout=30,
                         headers={**basic, "Content-Type": "text/plain"})
    assert form.status_code == 415
    foreign = requests.post(f"{world.server.url}{V1}/tag", data=json.dumps(body), timeout=30,
                            headers={**basic, "Content-Type": "application/json",
                                     "Origin": "https://evil.example"})
    assert foreign.status_code == 403
    upload = requests.post(f"{world.server.url}/v2/team/csrf/blobs/uploads/", timeout=30,
                           headers={**basic, "Origin": "null"})
    assert upload.status_code == 403
    tags = world.get("a", f"{V1}/tags", pattern="team/csrf").json()["tags"]
    assert [t["tag"] for t in tags] == ["v1"]
    own = requests.post(f"{world.server.url}{V1}/tag", data=json.dumps(body), timeout=30,
                        headers={**basic, "Content-Type": "application/json",
                                 "Origin": world.server.url})
    assert own.status_code == 200, own.text


# --- a corrupt stored blob is never served as a complete response ---------------------


def _oci_blob(world: World, repo: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    auth = _auth(world.tokens["a"])
    start = requests.post(f"{world.server.url}/v2/{repo}/blobs/uploads/", headers=auth,
                          timeout=30)
    assert start.status_code == 202, start.text
    put = requests.put(f"{world.server.url}{start.headers['Location']}",
                       params={"digest": digest}, data=data, timeout=60,
                       headers={**auth, "Content-Type": "application/octet-stream"})
    assert put.status_code == 201, put.text
    return digest


def _corrupt_last_byte(world: World, digest: str) -> None:
    found = [p for p in (world.root / "server").rglob(digest[9:]) if p.is_file()]
    assert len(found) == 1, found
    raw = bytearray(found[0].read_bytes())
    raw[-1] ^= 0xFF
    found[0].write_bytes(bytes(raw))


@pytest.mark.parametrize("size", [100_000, 6 << 20])
def test_corrupt_raw_oci_blob_is_never_a_clean_200(world: World, size: int) -> None:
    data = os.urandom(size)
    digest = _oci_blob(world, "team/raw", data)
    _corrupt_last_byte(world, digest)
    url = f"{world.server.url}/v2/team/raw/blobs/{digest}"
    with requests.get(url, headers=_auth(world.tokens["a"]), stream=True, timeout=60) as r:
        if size <= 4 << 20:  # checked before the status line
            assert r.status_code == 500, r.status_code
            return
        assert r.status_code == 200
        got = bytearray()
        with pytest.raises(requests.exceptions.RequestException):
            for piece in r.iter_content(1 << 16):
                got += piece
        assert len(got) < size and bytes(got) == data[:len(got)]
    assert world.server.alive()

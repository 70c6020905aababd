"""`kvgraft serve` over real HTTP: a graft as an OCI artifact, tokens and scopes, and bad
input refused with the right status and OCI error code, with nothing half-stored and the
server still serving. One server (SQLite catalog, local store) for the module."""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.serve import Server, kvgraft, make_token, running_server, server_env
from tests.support.synthetic import write_synthetic

TEAM = "team/kv"
MAX_UPLOAD = 1 << 20
MAX_OPEN = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("server")
    env = server_env(home / "home")
    src = home / "graft.safetensors"
    write_synthetic(src, tokens=300)
    kvgraft(env, "push", str(src), f"{TEAM}:v1", "--chunk-tokens", "128", "--label", "k=v")
    kvgraft(env, "push", str(src), "open/kv:v1", "--chunk-tokens", "128")
    kvgraft(env, "key", "generate", "release")
    kvgraft(env, "sign", f"{TEAM}:v1", "--key", "release")
    with running_server(env, home / "server.log", "--public", "open/*",
                        "--max-upload", str(MAX_UPLOAD), "--max-open-uploads", str(MAX_OPEN),
                        ) as srv:
        yield srv
        assert srv.alive()
    assert "Traceback" not in (home / "server.log").read_text()


@pytest.fixture(scope="module")
def tokens(server: Server) -> dict[str, str]:
    e = server.env
    return {
        "pull": make_token(e, "puller", f"repository:{TEAM}:pull"),
        "push": make_token(e, "pusher", "repository:team/*:pull,push"),
        "delete": make_token(e, "deleter", "repository:team/*:pull,push,delete"),
        "admin": make_token(e, "admin", "repository:*:admin"),
    }


def _auth(secret: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def _error(r: requests.Response) -> str:
    code: str = r.json()["errors"][0]["code"]
    return code


def _push_blob(server: Server, repo: str, data: bytes, secret: str) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    r = requests.post(f"{server.url}/v2/{repo}/blobs/uploads/?digest={digest}", data=data,
                      headers={**_auth(secret), "Content-Type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    return digest


def _image(config: str, layers: list[tuple[str, int]], **more: Any) -> bytes:
    doc = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                      "digest": config, "size": 2},
           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d,
                       "size": n} for d, n in layers], **more}
    return json.dumps(doc).encode()


def _put_manifest(server: Server, repo: str, ref: str, raw: bytes,
                  secret: str) -> requests.Response:
    return requests.put(f"{server.url}/v2/{repo}/manifests/{ref}", data=raw, headers={
        **_auth(secret), "Content-Type": "application/vnd.oci.image.manifest.v1+json"})


# --- a graft as an OCI artifact ---------------------------------------------------------


def test_graft_is_one_oci_manifest_whose_blobs_hash_to_their_descriptors(
        server: Server, tokens: dict[str, str]) -> None:
    h = _auth(tokens["pull"])
    r = requests.get(f"{server.url}/v2/{TEAM}/manifests/v1", headers=h)
    assert r.status_code == 200, r.text
    oci = r.json()
    digest = r.headers["Docker-Content-Digest"]
    assert digest == "sha256:" + hashlib.sha256(r.content).hexdigest()
    assert oci["artifactType"] == "application/vnd.kvgraft.graft.v1"
    assert r.headers["Content-Type"] == oci["mediaType"]
    for desc in [oci["config"], *oci["layers"]]:
        b = requests.get(f"{server.url}/v2/{TEAM}/blobs/{desc['digest']}", headers=h)
        assert b.status_code == 200, (desc, b.text)
        assert len(b.content) == desc["size"]
        assert "sha256:" + hashlib.sha256(b.content).hexdigest() == desc["digest"]
    kv_manifest = requests.get(f"{server.url}/v2/{TEAM}/blobs/{oci['layers'][0]['digest']}",
                               headers=h).json()
    assert kv_manifest["mediaType"] == "application/vnd.kvgraft.manifest.v1+json"
    by_digest = requests.get(f"{server.url}/v2/{TEAM}/manifests/{digest}", headers=h)
    assert by_digest.content == r.content
    resolved = requests.get(f"{server.url}/kvgraft/v1/resolve", params={"ref": f"{TEAM}:v1"},
                            headers=h).json()
    assert resolved == {"reference": f"{TEAM}:v1", "digest": oci["layers"][0]["digest"],
                        "oci_digest": digest}
    tags = requests.get(f"{server.url}/v2/{TEAM}/tags/list", headers=h).json()
    assert tags == {"name": TEAM, "tags": ["v1"]}
    labels = requests.get(f"{server.url}/kvgraft/v1/labels", params={"ref": f"{TEAM}:v1"},
                          headers=h).json()
    assert labels["labels"] == {"k": "v"}
    rng = requests.get(f"{server.url}/v2/{TEAM}/blobs/{oci['layers'][-1]['digest']}",
                       headers={**h, "Range": "bytes=10-19"})
    assert rng.status_code == 206 and len(rng.content) == 10


def test_kvgraft_api_artifact_models_and_prefix_match(server: Server,
                                                      tokens: dict[str, str]) -> None:
    h = _auth(tokens["pull"])
    art = requests.get(f"{server.url}/kvgraft/v1/artifact", params={"ref": f"{TEAM}:v1"},
                       headers=h)
    assert art.status_code == 200, art.text
    info = art.json()
    assert info["repositories"] == [TEAM]  # open/kv holds it too, but this token cannot see it
    models = requests.get(f"{server.url}/kvgraft/v1/models", headers=h).json()["models"]
    assert [m["name"] for m in models] == [info["model"]["name"]]
    oci = requests.get(f"{server.url}/v2/{TEAM}/manifests/v1", headers=h).json()
    ids_layer = next(x for x in oci["layers"]
                     if x["mediaType"] == "application/vnd.kvgraft.token-ids.v1")
    raw = requests.get(f"{server.url}/v2/{TEAM}/blobs/{ids_layer['digest']}", headers=h).content
    ids = list(struct.unpack(f"<{len(raw) // 8}q", raw))
    model = {k: info["model"][k] for k in ("architecture", "tokenizer", "weights")}
    query: dict[str, Any] = {"model": model, "tokens": [*ids[:200], -1, -2]}
    found = requests.post(f"{server.url}/kvgraft/v1/match", json=query, headers=h).json()
    assert found["match"]["digest"] == info["digest"] and found["match"]["length"] == 200
    # the GET form of earlier clients answers the same
    q = json.dumps(query)
    assert requests.get(f"{server.url}/kvgraft/v1/match", params={"q": q},
                        headers=h).json() == found
    stranger = make_token(server.env, "stranger", "repository:nothing/*:pull")
    hidden = requests.post(f"{server.url}/kvgraft/v1/match", json=query,
                           headers=_auth(stranger)).json()
    assert hidden == {"match": None}
    bad = requests.get(f"{server.url}/kvgraft/v1/match", params={"q": "{"}, headers=h)
    assert bad.status_code == 400
    bad = requests.post(f"{server.url}/kvgraft/v1/match", data="{",
                        headers={**h, "Content-Type": "application/json"})
    assert bad.status_code == 400


def test_anonymous_pull_only_from_public_repositories(server: Server) -> None:
    r = requests.get(f"{server.url}/v2/open/kv/manifests/v1")
    assert r.status_code == 200
    r = requests.get(f"{server.url}/v2/{TEAM}/manifests/v1")
    assert r.status_code == 401 and _error(r) == "UNAUTHORIZED"
    assert r.headers["WWW-Authenticate"].startswith('Bearer realm="')
    r = requests.post(f"{server.url}/v2/open/kv/blobs/uploads/")
    assert r.status_code == 401 and _error(r) == "UNAUTHORIZED"


def test_signatures_of_a_graft_are_its_referrers(server: Server,
                                                 tokens: dict[str, str]) -> None:
    h = _auth(tokens["pull"])
    graft = requests.get(f"{server.url}/v2/{TEAM}/manifests/v1", headers=h)
    subject = graft.headers["Docker-Content-Digest"]
    r = requests.get(f"{server.url}/v2/{TEAM}/referrers/{subject}", headers=h)
    assert r.status_code == 200, r.text
    found = r.json()["manifests"]
    assert [d["artifactType"] for d in found] == ["application/vnd.dsse.envelope.v1+json"]
    att = requests.get(f"{server.url}/v2/{TEAM}/manifests/{found[0]['digest']}", headers=h)
    assert att.status_code == 200
    assert "sha256:" + hashlib.sha256(att.content).hexdigest() == found[0]["digest"]
    doc = att.json()
    assert doc["subject"]["digest"] == subject
    layer = doc["layers"][0]
    blob = requests.get(f"{server.url}/v2/{TEAM}/blobs/{layer['digest']}", headers=h)
    assert "sha256:" + hashlib.sha256(blob.content).hexdigest() == layer["digest"]
    assert json.loads(blob.content)["payloadType"] == "application/vnd.in-toto+json"
    filtered = requests.get(f"{server.url}/v2/{TEAM}/referrers/{subject}",
                            params={"artifactType": "application/x-none"}, headers=h)
    assert filtered.json()["manifests"] == []
    assert filtered.headers["OCI-Filters-Applied"] == "artifactType"
    # not visible from a repository that does not hold the graft
    other = requests.get(f"{server.url}/v2/team/other/manifests/{found[0]['digest']}",
                         headers=_auth(tokens["admin"]))
    assert other.status_code == 404 and _error(other) == "MANIFEST_UNKNOWN"


# --- tokens and scopes ------------------------------------------------------------------


def test_scopes_are_enforced_per_repository_and_action(server: Server,
                                                       tokens: dict[str, str]) -> None:
    r = requests.post(f"{server.url}/v2/{TEAM}/blobs/uploads/", headers=_auth(tokens["pull"]))
    assert r.status_code == 403 and _error(r) == "DENIED"
    assert "puller" in r.json()["errors"][0]["message"]
    r = requests.get(f"{server.url}/v2/other/x/tags/list", headers=_auth(tokens["push"]))
    assert r.status_code == 403 and _error(r) == "DENIED"
    digest = _push_blob(server, "team/oci", b"layer", tokens["push"])
    r = requests.delete(f"{server.url}/v2/team/oci/blobs/{digest}", headers=_auth(tokens["push"]))
    assert r.status_code == 403
    r = requests.delete(f"{server.url}/v2/team/oci/blobs/{digest}",
                        headers=_auth(tokens["delete"]))
    assert r.status_code == 202
    r = requests.get(f"{server.url}/kvgraft/v1/log", headers=_auth(tokens["push"]))
    assert r.status_code == 403
    events = requests.get(f"{server.url}/kvgraft/v1/log", headers=_auth(tokens["admin"]))
    actors = {(e["action"], e["actor"]) for e in events.json()["events"]}
    assert ("oci-delete-blob", "token:deleter") in actors
    assert not any("kvg_" in json.dumps(e) for e in events.json()["events"])


def test_basic_and_token_flow_credentials(server: Server, tokens: dict[str, str]) -> None:
    r = requests.get(f"{server.url}/v2/", auth=("anyone", tokens["pull"]))
    assert r.status_code == 200
    t = requests.get(f"{server.url}/v2/token",
                     params={"service": "kvgraft", "scope": f"repository:{TEAM}:pull"},
                     auth=("anyone", tokens["pull"]))
    assert t.status_code == 200
    bearer = t.json()["token"]
    r = requests.get(f"{server.url}/v2/{TEAM}/tags/list", headers=_auth(bearer))
    assert r.status_code == 200
    r = requests.get(f"{server.url}/v2/", auth=("anyone", "kvg_wrong"))
    assert r.status_code == 401 and _error(r) == "UNAUTHORIZED"


def test_expired_and_revoked_tokens_are_refused(server: Server) -> None:
    env = server.env
    revoked = make_token(env, "soon-revoked", f"repository:{TEAM}:pull")
    expired = make_token(env, "short-lived", f"repository:{TEAM}:pull", expires="1s")
    assert requests.get(f"{server.url}/v2/{TEAM}/tags/list",
                        headers=_auth(revoked)).status_code == 200
    kvgraft(env, "token", "revoke", "soon-revoked")
    import time

    time.sleep(1.2)
    for secret, word in ((revoked, "revoked"), (expired, "expired")):
        r = requests.get(f"{server.url}/v2/{TEAM}/tags/list", headers=_auth(secret))
        assert r.status_code == 401 and _error(r) == "UNAUTHORIZED"
        assert word in r.json()["errors"][0]["message"]
    listed = [json.loads(line) for line in
              kvgraft(env, "token", "ls", "--json").splitlines()]
    states = {t["name"]: t["state"] for t in listed}
    assert states["soon-revoked"] == "revoked" and states["short-lived"] == "expired"
    assert all("secret" not in t for t in listed)
    catalog = (Path(env["KVGRAFT_HOME"]) / "catalog.db").read_bytes()
    assert revoked.encode() not in catalog and expired.encode() not in catalog


def test_token_cli_refuses_bad_scopes_and_names_exit_codes(server: Server) -> None:
    bad = subprocess.run([sys.executable, "-m", "kvgraft.cli", "token", "create", "--scope",
                          "repository:team/*:fly"], env=server.env, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "unknown action" in bad.stderr
    dup = subprocess.run([sys.executable, "-m", "kvgraft.cli", "token", "create", "--scope",
                          "repository:x:pull", "--name", "puller"], env=server.env,
                         capture_output=True, text=True)
    assert dup.returncode == 6
    gone = subprocess.run([sys.executable, "-m", "kvgraft.cli", "token", "revoke", "nobody"],
                          env=server.env, capture_output=True, text=True)
    assert gone.returncode == 3


# --- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Team/kv", "team/../kv", "team//kv", "-team/kv",
                                  "team/kv%2F..%2Fx"])
def test_bad_repository_names(server: Server, tokens: dict[str, str], name: str) -> None:
    r = requests.get(f"{server.url}/v2/{name}/tags/list", headers=_auth(tokens["admin"]))
    assert r.status_code in (400, 404), r.text
    if r.status_code == 400:
        assert _error(r) == "NAME_INVALID"


def test_digest_mismatch_stores_nothing(server: Server, tokens: dict[str, str]) -> None:
    h = _auth(tokens["push"])
    wrong = "sha256:" + hashlib.sha256(b"other").hexdigest()
    r = requests.post(f"{server.url}/v2/team/bad/blobs/uploads/?digest={wrong}", data=b"data",
                      headers=h)
    assert r.status_code == 400 and _error(r) == "DIGEST_INVALID"
    assert requests.head(f"{server.url}/v2/team/bad/blobs/{wrong}", headers=h).status_code == 404
    # chunked: the same, and the upload is gone afterwards
    start = requests.post(f"{server.url}/v2/team/bad/blobs/uploads/", headers=h)
    loc = server.url + start.headers["Location"]
    requests.patch(loc, data=b"data", headers={**h, "Content-Range": "0-3"})
    r = requests.put(loc, params={"digest": wrong}, headers=h)
    assert r.status_code == 400 and _error(r) == "DIGEST_INVALID"
    assert requests.get(loc, headers=h).status_code == 404


def test_truncated_upload_stores_nothing_and_server_serves_on(
        server: Server, tokens: dict[str, str]) -> None:
    data = b"x" * 5000
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall((f"POST /v2/team/trunc/blobs/uploads/?digest={digest} HTTP/1.1\r\n"
                   f"Host: x\r\nAuthorization: Bearer {tokens['push']}\r\n"
                   f"Content-Length: {len(data)}\r\n\r\n").encode() + data[:1000])
    h = _auth(tokens["push"])
    assert requests.head(f"{server.url}/v2/team/trunc/blobs/{digest}",
                         headers=h).status_code == 404
    upload_dir = Path(server.env["KVGRAFT_HOME"]) / "uploads"
    assert not list(upload_dir.glob(".mono-*"))
    assert requests.get(f"{server.url}/v2/", headers=h).status_code == 200


def test_upload_and_open_upload_limits(server: Server, tokens: dict[str, str]) -> None:
    h = _auth(tokens["push"])
    big = b"y" * (MAX_UPLOAD + 1)
    digest = "sha256:" + hashlib.sha256(big).hexdigest()
    r = requests.post(f"{server.url}/v2/team/big/blobs/uploads/?digest={digest}", data=big,
                      headers=h)
    assert r.status_code == 413 and _error(r) == "SIZE_INVALID"
    assert requests.head(f"{server.url}/v2/team/big/blobs/{digest}", headers=h).status_code == 404
    opened = []
    for _ in range(MAX_OPEN):
        r = requests.post(f"{server.url}/v2/team/big/blobs/uploads/", headers=h)
        if r.status_code == 202:
            opened.append(server.url + r.headers["Location"])
    r = requests.post(f"{server.url}/v2/team/big/blobs/uploads/", headers=h)
    assert r.status_code == 429 and _error(r) == "TOOMANYREQUESTS"
    for loc in opened:
        assert requests.delete(loc, headers=h).status_code == 204
    assert requests.post(f"{server.url}/v2/team/big/blobs/uploads/",
                         headers=h).status_code == 202


def test_out_of_order_chunk_is_416_and_upload_survives(server: Server,
                                                       tokens: dict[str, str]) -> None:
    h = _auth(tokens["push"])
    loc = server.url + requests.post(f"{server.url}/v2/team/chunks/blobs/uploads/",
                                     headers=h).headers["Location"]
    assert requests.patch(loc, data=b"abc", headers={**h, "Content-Range": "0-2"}
                          ).status_code == 202
    r = requests.patch(loc, data=b"xyz", headers={**h, "Content-Range": "5-7"})
    assert r.status_code == 416 and _error(r) == "BLOB_UPLOAD_INVALID"
    assert requests.get(loc, headers=h).headers["Range"] == "0-2"
    digest = "sha256:" + hashlib.sha256(b"abcdef").hexdigest()
    r = requests.put(loc, params={"digest": digest}, data=b"def",
                     headers={**h, "Content-Range": "3-5"})
    assert r.status_code == 201


def test_manifest_naming_missing_or_wrongly_sized_blobs_is_refused(
        server: Server, tokens: dict[str, str]) -> None:
    h = _auth(tokens["push"])
    config = _push_blob(server, "team/img", b"{}", tokens["push"])
    layer = _push_blob(server, "team/img", b"layer-bytes", tokens["push"])
    missing = "sha256:" + hashlib.sha256(b"never pushed").hexdigest()
    r = _put_manifest(server, "team/img", "v1", _image(config, [(missing, 12)]), tokens["push"])
    assert r.status_code == 400 and _error(r) == "MANIFEST_BLOB_UNKNOWN"
    # a blob bigger than the manifest declares
    r = _put_manifest(server, "team/img", "v1", _image(config, [(layer, 5)]), tokens["push"])
    assert r.status_code == 400 and _error(r) == "MANIFEST_INVALID"
    assert requests.get(f"{server.url}/v2/team/img/manifests/v1", headers=h).status_code == 404
    good = _image(config, [(layer, len(b"layer-bytes"))])
    assert _put_manifest(server, "team/img", "v1", good, tokens["push"]).status_code == 201
    got = requests.get(f"{server.url}/v2/team/img/manifests/v1", headers=h)
    assert got.content == good
    # a tag that names a graft is not overwritten by an OCI push
    r = _put_manifest(server, TEAM, "v1", good, tokens["push"])
    assert r.status_code in (400, 409)


def test_a_pushed_manifest_whose_file_digest_is_not_its_tree_is_refused(
        server: Server, tokens: dict[str, str]) -> None:
    # The served graft's own manifest, with its file digest changed: the tree over its
    # blobs no longer matches, so the commit is refused before anything is recorded.
    h = _auth(tokens["push"])
    oci = requests.get(f"{server.url}/v2/{TEAM}/manifests/v1", headers=h).json()
    raw = requests.get(f"{server.url}/v2/{TEAM}/blobs/{oci['layers'][0]['digest']}",
                       headers=h).content
    doc = json.loads(raw)
    assert doc["schemaVersion"] == 2
    doc["file"]["digest"] = "sha256:" + hashlib.sha256(b"some other file").hexdigest()
    forged = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    r = requests.post(f"{server.url}/kvgraft/v1/push", headers=h,
                      json={"repository": TEAM, "tag": "forged", "manifest": forged})
    assert r.status_code == 400 and _error(r) == "MANIFEST_INVALID"
    assert "tree of its blobs" in r.json()["errors"][0]["message"]
    assert requests.get(f"{server.url}/v2/{TEAM}/manifests/forged",
                        headers=h).status_code == 404


def test_oversized_manifest_and_header(server: Server, tokens: dict[str, str]) -> None:
    h = _auth(tokens["push"])
    huge = b'{"schemaVersion":2,"pad":"' + b"a" * (4 << 20) + b'"}'
    r = _put_manifest(server, "team/img", "huge", huge, tokens["push"])
    assert r.status_code == 413 and _error(r) == "MANIFEST_INVALID"
    try:
        r = requests.get(f"{server.url}/v2/", headers={**h, "X-Pad": "a" * (128 << 10)})
        assert r.status_code == 431 and _error(r) == "SIZE_INVALID"
    except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
        pass  # h11 may drop the connection instead: also a refusal
    r = requests.get(f"{server.url}/v2/", headers={"Authorization": "Bearer " + "a" * 5000})
    assert r.status_code == 401
    assert requests.get(f"{server.url}/v2/", headers=h).status_code == 200


def test_gc_keeps_what_oci_manifests_name_and_fresh_uploads(
        server: Server, tokens: dict[str, str]) -> None:
    """As an OCI registry's gc: blobs a manifest names stay, uploads inside the grace
    period stay (their manifest may be on its way), an old upload nothing names goes."""
    h = _auth(tokens["push"])
    config = _push_blob(server, "team/keep", b"{}", tokens["push"])
    layer = _push_blob(server, "team/keep", b"kept by gc", tokens["push"])
    stray = _push_blob(server, "team/keep", b"named by nothing", tokens["push"])
    image = _image(config, [(layer, len(b"kept by gc"))])
    assert _put_manifest(server, "team/keep", "v1", image, tokens["push"]).status_code == 201
    kvgraft(server.env, "gc")  # the default grace: every upload is young
    assert requests.get(f"{server.url}/v2/team/keep/blobs/{stray}", headers=h).status_code \
        == 200
    kvgraft(server.env, "gc", "--grace", "0s")
    r = requests.get(f"{server.url}/v2/team/keep/blobs/{layer}", headers=h)
    assert r.status_code == 200 and r.content == b"kept by gc"
    assert requests.get(f"{server.url}/v2/team/keep/manifests/v1", headers=h).content == image
    assert requests.get(f"{server.url}/v2/team/keep/blobs/{stray}", headers=h).status_code \
        == 404

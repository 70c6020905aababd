"""16 concurrent clients pushing and pulling through `kvgraft serve` (two workers), on
SQLite + a local store and on PostgreSQL + S3: every request succeeds, every byte pulled
checks, every client's own tag ends on its own manifest (no lost update), the shared tag
ends on one of the pushed manifests, and the server logs no traceback."""

from __future__ import annotations

import hashlib
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.support.serve import kvgraft, make_token, running_server, server_env
from tests.support.synthetic import write_synthetic

CLIENTS = 16
ROUNDS = 3
SHARED = [random.Random(i).randbytes(64 << 10) for i in range(4)]  # blobs all clients push


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _client(url: str, secret: str, n: int) -> list[str]:
    """One client's pushes and pulls; returns what went wrong (nothing, we hope)."""
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {secret}"
    errors: list[str] = []
    repo = f"load/c{n % 4}"  # four repositories, four clients each
    rng = random.Random(1000 + n)

    def check(r: requests.Response, *ok: int) -> requests.Response:
        if r.status_code not in ok:
            errors.append(f"{r.request.method} {r.url}: {r.status_code} {r.text[:200]}")
        return r

    pushed: dict[str, bytes] = {}
    for rnd in range(ROUNDS):
        own = rng.randbytes(rng.randrange(1, 300 << 10))
        layers = [own, SHARED[(n + rnd) % len(SHARED)]]
        for data in layers:
            d = _digest(data)
            if rnd % 2:  # chunked, in two pieces
                r = check(s.post(f"{url}/v2/{repo}/blobs/uploads/"), 202)
                loc = url + r.headers.get("Location", "")
                half = len(data) // 2
                check(s.patch(loc, data=data[:half],
                              headers={"Content-Range": f"0-{half - 1}"}), 202)
                check(s.put(loc, params={"digest": d}, data=data[half:],
                            headers={"Content-Range": f"{half}-{len(data) - 1}"}), 201)
            else:
                check(s.post(f"{url}/v2/{repo}/blobs/uploads/", params={"digest": d},
                             data=data), 201)
        config = json.dumps({"client": n, "round": rnd}).encode()
        check(s.post(f"{url}/v2/{repo}/blobs/uploads/", params={"digest": _digest(config)},
                     data=config), 201)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": _digest(config), "size": len(config)},
            "layers": [{"mediaType": "application/octet-stream", "digest": _digest(x),
                        "size": len(x)} for x in layers]}).encode()
        for tag in (f"client{n}", "shared"):
            check(s.put(f"{url}/v2/{repo}/manifests/{tag}", data=manifest, headers={
                "Content-Type": "application/vnd.oci.image.manifest.v1+json"}), 201)
        pushed[_digest(manifest)] = manifest
        # pull back: the own tag, every blob, and the graft everybody shares
        r = check(s.get(f"{url}/v2/{repo}/manifests/client{n}"), 200)
        if r.content != manifest:
            errors.append(f"client{n}: tag does not give back its manifest")
        for data in layers:
            got = check(s.get(f"{url}/v2/{repo}/blobs/{_digest(data)}"), 200)
            if got.content != data:
                errors.append(f"client{n}: blob {_digest(data)} came back different")
        graft = check(s.get(f"{url}/v2/load/graft/manifests/v1"), 200)
        if graft.status_code == 200:
            for desc in graft.json()["layers"]:
                b = check(s.get(f"{url}/v2/load/graft/blobs/{desc['digest']}"), 200)
                if _digest(b.content) != desc["digest"]:
                    errors.append(f"client{n}: graft blob {desc['digest']} does not check")
    last = check(s.get(f"{url}/v2/{repo}/manifests/client{n}"), 200)
    if _digest(last.content) not in pushed or last.content != manifest:
        errors.append(f"client{n}: lost update on its own tag")
    return errors


def _load(tmp_path: Path, env: dict[str, str]) -> None:
    src = tmp_path / "graft.safetensors"
    write_synthetic(src, tokens=600)
    kvgraft(env, "push", str(src), "load/graft:v1", "--chunk-tokens", "128")
    secret = make_token(env, "load", "repository:load/*:pull,push")
    log = tmp_path / "server.log"
    with running_server(env, log, "--workers", "2") as server:
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(lambda n: _client(server.url, secret, n), range(CLIENTS)))
        errors = [e for r in results for e in r]
        assert not errors, errors[:20]
        s = requests.Session()
        s.headers["Authorization"] = f"Bearer {secret}"
        for repo in range(4):
            tags = s.get(f"{server.url}/v2/load/c{repo}/tags/list").json()["tags"]
            assert sorted(tags) == sorted([*(f"client{n}" for n in range(repo, CLIENTS, 4)),
                                           "shared"])
        assert server.alive()
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
    events = kvgraft(env, "log", "--json", "--action", "oci-push").splitlines()
    assert len(events) == CLIENTS * ROUNDS * 2  # the own tag and the shared one


@pytest.mark.slow
def test_load_sqlite_local(tmp_path: Path) -> None:
    _load(tmp_path, server_env(tmp_path / "home"))


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.s3
def test_load_postgres_s3(tmp_path: Path, postgres_url: str, s3_store_url: str) -> None:
    env = server_env(tmp_path / "home", KVGRAFT_CATALOG_URL=postgres_url,
                     KVGRAFT_BLOB_URL=s3_store_url)
    kvgraft(env, "db", "upgrade")
    _load(tmp_path, env)

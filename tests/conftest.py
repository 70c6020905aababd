"""Shared fixtures: registries on real backends (SQLite and PostgreSQL catalogs; local,
memory and S3 blob stores). Under CI=true a backend that cannot be reached fails the run
instead of skipping."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from kvgraft.catalog import Catalog
from kvgraft.client import Registry
from kvgraft.config import Config
from tests.support.daemons import ensure_postgres, ensure_s3
from tests.support.harness import RegistryFactory, s3_base_url, unavailable
from tests.support.vllm_cluster import Q1, Q2, node_env, node_model, run_node


@pytest.fixture(scope="session")
def postgres_server() -> str:
    url = ensure_postgres()
    if url is None:
        unavailable("PostgreSQL")
    assert url is not None
    return url


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty schema on the test server, as a catalog URL."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_server)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in postgres_server else "?"
    yield f"{postgres_server}{sep}options=-csearch_path%3D{schema}"
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


# "s3" is SeaweedFS, "ceph" Ceph's RADOS Gateway: two real S3 servers that differ where S3
# servers do (checksum headers, ETags, conditional writes).
STORE_KINDS = ["local", "memory", "s3", "ceph"]
S3_KINDS = {"s3": "s3_store_url", "ceph": "ceph_store_url"}


@pytest.fixture(params=STORE_KINDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    kind = request.param
    if kind == "local":
        return (tmp_path / "blobs").as_uri()
    if kind == "memory":
        return f"memory://{uuid.uuid4().hex}"
    url: str = request.getfixturevalue(S3_KINDS[kind])
    return url


@pytest.fixture(params=list(S3_KINDS))
def any_s3_store_url(request: pytest.FixtureRequest) -> str:
    """A fresh prefix on each real S3 server in turn."""
    url: str = request.getfixturevalue(S3_KINDS[request.param])
    return url


@pytest.fixture
def ceph_store_url(monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh prefix in a bucket of Ceph RGW on loopback, started once per session (about
    14 s); the AWS_* variables point at it for the test (and the processes it starts)."""
    from tests.support.daemons import TEST_BUCKET, ensure_ceph

    server = ensure_ceph()
    if server is None:
        unavailable("Ceph RGW on loopback (Debian packages ceph-mon ceph-osd radosgw)")
    assert server is not None
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    for name in ("KVGRAFT_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_PROFILE",
                 "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return f"s3://{TEST_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture
def s3_store_url() -> str:
    """A fresh prefix in a bucket of a real S3 server on loopback."""
    return f"{s3_base_url()}/{uuid.uuid4().hex}"


@pytest.fixture
def make_registry(tmp_path: Path) -> RegistryFactory:
    """Registries that share a tmp KVGRAFT_HOME unless told otherwise."""

    def make(*, home: Path | None = None, catalog_url: str | None = None,
             blob_url: str | None = None, cache_dir: Path | None = None) -> Registry:
        home = home or tmp_path / "home"
        env = {"KVGRAFT_HOME": str(home), "KVGRAFT_CACHE": str(cache_dir or home / "cache")}
        return Registry(Config.from_env(env, catalog_url=catalog_url, blob_url=blob_url))

    return make


@pytest.fixture
def registry(make_registry: RegistryFactory) -> Iterator[Registry]:
    reg = make_registry()
    yield reg
    reg.close()


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    """Environment for running the CLI in a subprocess against a tmp home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    env.update(KVGRAFT_HOME=str(tmp_path / "home"), KVGRAFT_CACHE=str(tmp_path / "cache"))
    return env


# The vLLM tests' cluster (support/vllm_cluster.py), one per module that asks: each node is
# an engine start (~35 s on 2 cores), so the tests of a module share them.
@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    """One PostgreSQL catalog (a fresh schema) and one S3 prefix, as the nodes' env."""
    pg, s3 = ensure_postgres(), ensure_s3()
    if pg is None:
        unavailable("PostgreSQL")
    if s3 is None:
        unavailable("an S3 server on loopback")
    assert pg is not None and s3 is not None
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(pg)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in pg else "?"
    url = f"{pg}{sep}options=-csearch_path%3D{schema}"
    Catalog.open(url, auto_upgrade=True).close()
    # ensure_s3 put the endpoint and credentials in os.environ, which the nodes inherit
    yield {"KVGRAFT_CATALOG_URL": url, "KVGRAFT_BLOB_URL": f"{s3}/{uuid.uuid4().hex}"}
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, cluster: dict[str, str]) -> dict[str, Any]:
    """Node A has computed Q1 twice and Q2, publishing their full chunks."""
    root = tmp_path_factory.mktemp("vllm")
    models = {"m0": node_model(root / "m0", 0), "m1": node_model(root / "m1", 1)}
    a = run_node(models["m0"], node_env(cluster, root / "a"), [Q1, Q1, Q2])
    return {"root": root, "shared": cluster, "models": models, "a": a}

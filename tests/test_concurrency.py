"""Concurrency and crash safety with real processes, on SQLite and PostgreSQL catalogs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraft.catalog import Catalog
from kvgraft.reference import Reference
from tests.support.synthetic import write_synthetic

CLI = "from kvgraft.cli.main import main; main()"


@pytest.fixture
def env(cli_env: dict[str, str], catalog_url: str, tmp_path: Path) -> dict[str, str]:
    env = {**cli_env, "KVGRAFT_CATALOG_URL": catalog_url,
           "KVGRAFT_BLOB_URL": (tmp_path / "store").as_uri()}
    subprocess.run([sys.executable, "-c", CLI, "db", "upgrade"], env=env, check=True,
                   capture_output=True)
    return env


def _spawn(env: dict[str, str], *args: str, code: str = CLI) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _blob_files(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "store").rglob("*") if p.is_file()]


def test_same_artifact_from_many_processes(env: dict[str, str], tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=2000, num_layers=6)
    procs = [_spawn(env, "push", str(src), "race/a:x", "--json") for _ in range(6)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, [e for _, e in outs]
    assert len({json.loads(o)["digest"] for o, _ in outs}) == 1
    assert sum(json.loads(o)["created"] for o, _ in outs) == 1
    catalog = Catalog.open(env["KVGRAFT_CATALOG_URL"])
    try:
        assert len(catalog.artifact_digests()) == 1
        assert len(catalog.events(action="push")) == 6
        blobs = {p.name for p in _blob_files(tmp_path)}
        assert len(_blob_files(tmp_path)) == len(blobs) == 10  # one copy each, no temp files
    finally:
        catalog.close()
    r = subprocess.run([sys.executable, "-c", CLI, "verify", "race/a:x"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_different_artifacts_to_one_tag(env: dict[str, str], tmp_path: Path) -> None:
    files = [write_synthetic(tmp_path / f"{i}.kv", tokens=700, seed=i) for i in range(6)]
    procs = [_spawn(env, "push", str(f), "race/tag:hot", "--json") for f in files]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, [e for _, e in outs]
    assert all("Traceback" not in e for _, e in outs)
    digests = {json.loads(o)["digest"] for o, _ in outs}
    assert len(digests) == 6
    catalog = Catalog.open(env["KVGRAFT_CATALOG_URL"])
    try:
        assert str(catalog.resolve(Reference.parse("race/tag:hot"))) in digests
        events = catalog.events(action="push")
        assert sorted(str(e.digest) for e in events) == sorted(digests)
        assert len(catalog.artifact_digests()) == 6
    finally:
        catalog.close()


KILL_BEFORE_COMMIT = """
import os, signal
from kvgraft.catalog.catalog import Catalog
def die(self, push):
    os.kill(os.getpid(), signal.SIGKILL)
Catalog.record_push = die
from kvgraft.cli.main import main
main()
"""


def test_push_killed_before_commit_leaves_catalog_consistent(env: dict[str, str],
                                                             tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=1200)
    p = _spawn(env, "push", str(src), "crash/a", code=KILL_BEFORE_COMMIT)
    p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL
    assert len(_blob_files(tmp_path)) == 7  # all blobs landed, the commit never happened
    catalog = Catalog.open(env["KVGRAFT_CATALOG_URL"])
    try:
        assert catalog.artifact_digests() == []
        assert catalog.list_tags() == ()
    finally:
        catalog.close()
    r = subprocess.run([sys.executable, "-c", CLI, "push", str(src), "crash/a", "--json"],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["created"] and result["blobs_stored"] == 0  # the re-push completes it
    r = subprocess.run([sys.executable, "-c", CLI, "pull", "crash/a", "-o",
                        str(tmp_path / "o.kv")], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and (tmp_path / "o.kv").read_bytes() == src.read_bytes()


DROP_CONNECTION = """
import sys
from sqlalchemy import create_engine, text
from kvgraft.catalog.catalog import Catalog
ADMIN = sys.argv.pop(1)
real = Catalog._move_tag
def cut(self, s, *args):
    # Kill this session's own server process from outside, mid-transaction.
    pid = s.execute(text("SELECT pg_backend_pid()")).scalar()
    admin = create_engine(ADMIN)
    with admin.connect() as conn:
        conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
    admin.dispose()
    return real(self, s, *args)
Catalog._move_tag = cut
from kvgraft.cli.main import main
main()
"""


def test_catalog_connection_lost_mid_push(env: dict[str, str], tmp_path: Path,
                                          catalog_url: str, request: pytest.FixtureRequest,
                                          ) -> None:
    if not catalog_url.startswith("postgresql"):
        pytest.skip("a server connection can only be cut on PostgreSQL")
    server: str = request.getfixturevalue("postgres_server")
    src = write_synthetic(tmp_path / "a.kv", tokens=600)
    p = _spawn(env, server, "push", str(src), "cut/a", code=DROP_CONNECTION)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 7, err
    assert "catalog" in err and "Traceback" not in err
    catalog = Catalog.open(catalog_url)
    try:
        assert catalog.artifact_digests() == [] and catalog.events() == []
    finally:
        catalog.close()

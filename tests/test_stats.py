"""`kvgraft stats`: artifacts, bytes stored and saved by sharing chunks, hits and last use by
repository, on SQLite and PostgreSQL, from the CLI, and through a server (only what the
token may pull)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraft.catalog import Catalog
from kvgraft.catalog.usage import UsageReport
from kvgraft.client import Registry
from tests.support.harness import RegistryFactory
from tests.support.serve import kvgraft, make_token, running_server, server_env
from tests.support.synthetic import write_synthetic


def _grafts(tmp_path: Path) -> tuple[Path, Path]:
    """Two grafts of different models whose chunks hold the same bytes (same seed): two
    artifacts, one set of chunk blobs."""
    return (write_synthetic(tmp_path / "a.kv", tokens=300, name="one"),
            write_synthetic(tmp_path / "b.kv", tokens=300, name="two"))


def _fill(reg: Registry, tmp_path: Path) -> None:
    a, b = _grafts(tmp_path)
    first = reg.push(a, "team/a:v1")
    reg.push(b, "team/a:v2")
    reg.push(a, "team/b:v1")
    reg.pull("team/a:v1")  # a hit for team/a
    # an event naming no repository counts for every repository holding its artifact;
    # one that failed counts for none
    reg.events.record("match", digest=first.digest)
    reg.events.record("restore", repository="team/b", digest=first.digest, outcome="failed")


def test_stats_by_repository(make_registry: RegistryFactory, catalog_url: str,
                             tmp_path: Path) -> None:
    Catalog.open(catalog_url, auto_upgrade=True).close()
    reg = make_registry(catalog_url=catalog_url, blob_url=(tmp_path / "blobs").as_uri())
    _fill(reg, tmp_path)
    report = reg.stats()
    by = {r.repository: r for r in report.repositories}
    assert sorted(by) == ["team/a", "team/b"]
    a, b = by["team/a"], by["team/b"]
    assert (a.artifacts, a.tags, a.hits) == (2, 2, 2)
    assert (b.artifacts, b.tags, b.hits) == (1, 1, 1)
    assert a.last_used is not None and b.last_used is not None
    assert a.deduplicated_bytes > 0 and a.stored_bytes + a.deduplicated_bytes == \
        a.referenced_bytes  # the chunks the two grafts share are stored once
    assert b.deduplicated_bytes == 0 and 0 < b.stored_bytes < a.stored_bytes
    assert report.total.artifacts == 2 and report.total.stored_bytes == a.stored_bytes
    only = reg.stats("team/b").repositories
    assert [r.repository for r in only] == ["team/b"]
    assert UsageReport.from_json(json.loads(json.dumps(report.to_json()))) == report
    reg.close()


def test_stats_of_a_registry_never_written_to_creates_nothing(tmp_path: Path) -> None:
    env = server_env(tmp_path / "home")
    out = json.loads(kvgraft(env, "stats", "--json"))
    assert out["repositories"] == [] and out["total"]["artifacts"] == 0
    assert not (tmp_path / "home" / "catalog.db").exists()


@pytest.mark.slow
def test_stats_from_the_cli_and_through_a_server(tmp_path: Path) -> None:
    env = server_env(tmp_path / "home")
    a, b = _grafts(tmp_path)
    kvgraft(env, "push", str(a), "team/a:v1")
    kvgraft(env, "push", str(b), "secret/x:v1")
    kvgraft(env, "pull", "team/a:v1")
    table = kvgraft(env, "stats")
    assert "team/a" in table and "secret/x" in table and "(total)" in table
    direct = json.loads(kvgraft(env, "stats", "team/*", "--json"))
    assert [r["repository"] for r in direct["repositories"]] == ["team/a"]
    assert direct["repositories"][0]["hits"] == 1
    with running_server(env, tmp_path / "server.log") as server:
        node = server_env(tmp_path / "node")
        token = tmp_path / "team.token"
        token.write_text(make_token(env, "team", "repository:team/*:pull") + "\n")
        kvgraft(node, "remote", "add", "hub", server.url, "--token-file", str(token))
        served = json.loads(kvgraft(node, "--remote", "hub", "stats", "--json"))
        assert [r["repository"] for r in served["repositories"]] == ["team/a"]
        assert served["repositories"][0] == direct["repositories"][0]
        bad = subprocess.run([sys.executable, "-m", "kvgraft.cli", "--remote", "hub", "stats",
                              "not a name!"], env=node, capture_output=True, text=True)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr

"""Two machines share one bucket and one catalog: each has its own home and cache and runs
kvgraft in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.synthetic import write_synthetic

CLI = "from kvgraft.cli.main import main; main()"


@pytest.mark.slow
def test_push_on_a_pull_on_b(cli_env: dict[str, str], postgres_url: str,
                             any_s3_store_url: str, tmp_path: Path) -> None:
    s3_store_url = any_s3_store_url
    # The S3 fixture points AWS_* at its server after cli_env was taken.
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}

    def machine(name: str) -> dict[str, str]:
        return {**cli_env, **aws, "KVGRAFT_HOME": str(tmp_path / name / "home"),
                "KVGRAFT_CACHE": str(tmp_path / name / "cache"),
                "KVGRAFT_CATALOG_URL": postgres_url, "KVGRAFT_BLOB_URL": s3_store_url}

    def kvgraft(env: dict[str, str], *args: str) -> str:
        r = subprocess.run([sys.executable, "-c", CLI, *args], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    a, b = machine("a"), machine("b")
    kvgraft(a, "db", "upgrade")
    v1 = write_synthetic(tmp_path / "v1.kv", tokens=1500, window=300, sliding=[1], seed=1)
    v2 = write_synthetic(tmp_path / "v2.kv", tokens=900, seed=2)
    d1 = json.loads(kvgraft(a, "push", str(v1), "shared/graft:prod", "--json"))["digest"]
    first = json.loads(kvgraft(b, "pull", "shared/graft:prod", "-o",
                               str(tmp_path / "b1.kv"), "--json"))
    assert first["digest"] == d1 and first["fetched"] > 0
    assert (tmp_path / "b1.kv").read_bytes() == v1.read_bytes()
    again = json.loads(kvgraft(b, "pull", "shared/graft:prod", "-o", str(tmp_path / "b2.kv"),
                               "--json"))
    assert again["fetched"] == 0 and again["fetched_bytes"] == 0
    d2 = json.loads(kvgraft(a, "push", str(v2), "shared/graft:prod", "--json"))["digest"]
    moved = json.loads(kvgraft(b, "pull", "shared/graft:prod", "-o", str(tmp_path / "b3.kv"),
                               "--json"))
    assert moved["digest"] == d2 != d1
    assert (tmp_path / "b3.kv").read_bytes() == v2.read_bytes()
    assert json.loads(kvgraft(b, "verify", "--all", "--json").splitlines()[0])["ok"]

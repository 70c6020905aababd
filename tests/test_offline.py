"""--offline means no catalog or store access: commands that need them are refused before
touching anything; the cache alone serves the rest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hostile import HOSTILE

# Neither can be reached: any attempt would fail with exit 7 (or hang), not exit 2.
NO_CATALOG = "postgresql+psycopg://nobody@127.0.0.1:1/none"
NO_STORE = "s3://no-such-bucket/kv"


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def pushed(cli_env: dict[str, str]) -> str:
    r = run(cli_env, "push", str(HOSTILE / "good.kv"), "off/line:v1")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("args", [
    ["push", str(HOSTILE / "good.kv"), "off/line:v2"],
    ["ls"],
    ["verify", "--all"],
    ["verify", "off/line:v1"],
    ["gc", "--dry-run"],
    ["gc"],
    ["inspect", "off/line:v1"],
    ["tag", "off/line:v1", "off/line:v3"],
    ["untag", "off/line:v1"],
    ["log"],
    ["audit", "off/line:v1"],
    ["provenance", "export", "off/line:v1"],
    ["db", "current"],
    ["db", "upgrade"],
])
def test_offline_refuses_what_needs_catalog_or_store(cli_env: dict[str, str], pushed: str,
                                                     args: list[str]) -> None:
    r = run(cli_env, "--offline", "--catalog", NO_CATALOG, "--store", NO_STORE, *args)
    assert r.returncode == 2, r.stderr
    assert "offline" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_offline_push_writes_nothing(cli_env: dict[str, str], tmp_path: Path) -> None:
    """With the default embedded catalog and store: no catalog file, no blob appears."""
    for env, flag in ((cli_env, ["--offline"]), (dict(cli_env, KVGRAFT_OFFLINE="1"), [])):
        r = run(env, *flag, "push", str(HOSTILE / "good.kv"), "off/line:v1")
        assert r.returncode == 2 and "offline" in r.stderr
    home = tmp_path / "home"
    assert not (home / "catalog.db").exists()
    assert not (home / "blobs").exists() or not any((home / "blobs").rglob("*"))


def test_offline_cache_commands_work(cli_env: dict[str, str], pushed: str,
                                     tmp_path: Path) -> None:
    assert run(cli_env, "pull", "off/line:v1").returncode == 0  # fills the cache
    args = ["--offline", "--catalog", NO_CATALOG, "--store", NO_STORE]
    out = tmp_path / "copy.kv"
    r = run(cli_env, *args, "pull", "off/line:v1", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == (HOSTILE / "good.kv").read_bytes()
    r = run(cli_env, *args, "cache", "ls", "--json")
    assert r.returncode == 0 and pushed in r.stdout

"""A catalog changed behind kvgraft's back: verify --all reports every problem, ls lists what
is sound, audit notices missing triggers, and odd KVGRAFT_HOME names stay paths."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from kvgraft.catalog import Catalog
from kvgraft.config import Config, default_catalog_url
from tests.support.harness import RegistryFactory
from tests.support.hostile import HOSTILE
from tests.support.synthetic import write_synthetic


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def push_three(env: dict[str, str], tmp_path: Path) -> list[str]:
    digests = []
    for i, name in enumerate(("t/a", "t/b", "t/c")):
        src = write_synthetic(tmp_path / f"{i}.kv", num_layers=1, kv_heads=1, head_dim=4,
                              tokens=4, seed=i)
        r = run(env, "push", str(src), f"{name}:v1")
        assert r.returncode == 0, r.stderr
        digests.append(r.stdout.strip())
    return digests


def sql(home: Path, *statements: str) -> None:
    db = sqlite3.connect(home / "catalog.db")
    try:
        db.execute("PRAGMA foreign_keys=OFF")
        for s in statements:
            db.execute(s)
        db.commit()
    finally:
        db.close()


def test_verify_all_reports_every_tampered_manifest_and_dangling_tag(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    a, b, c = push_three(cli_env, tmp_path)
    home = tmp_path / "home"
    ghost = "sha256:" + "ab" * 32
    sql(home, f"UPDATE artifacts SET manifest = replace(manifest, '\"chunkTokens\"', "
              f"'\"chunkTokenz\"') WHERE digest IN ('{a}', '{c}')",
        f"UPDATE tags SET artifact_digest = '{ghost}' WHERE repository = 't/b'")
    r = run(cli_env, "verify", "--all", "--json")
    assert r.returncode == 4, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    by_digest = {x["digest"]: x for x in lines if "digest" in x}
    assert set(by_digest) == {a, b, c}
    assert not by_digest[a]["ok"] and not by_digest[c]["ok"] and by_digest[b]["ok"]
    assert "manifest" in by_digest[a]["problems"][0]
    assert lines[-1] == {"ok": False, "problem": f"tag t/b:v1 points at {ghost}, which is "
                                                 "not in the catalog"}
    assert a[7:19] in r.stderr and c[7:19] in r.stderr and "t/b:v1" in r.stderr
    assert "3 problem(s)" in r.stderr


@pytest.mark.slow
def test_one_malformed_tag_digest_does_not_hide_the_rest(cli_env: dict[str, str],
                                                         tmp_path: Path) -> None:
    push_three(cli_env, tmp_path)
    sql(tmp_path / "home", "UPDATE tags SET artifact_digest = 'sha256:zz' "
                           "WHERE repository = 't/b'")
    r = run(cli_env, "ls", "--json")
    assert r.returncode == 4, r.stderr
    assert [json.loads(line)["repository"] for line in r.stdout.splitlines()] == ["t/a", "t/c"]
    assert "t/b:v1" in r.stderr and "malformed digest" in r.stderr
    r = run(cli_env, "ls")
    assert r.returncode == 4 and "t/a" in r.stdout and "t/c" in r.stdout
    r = run(cli_env, "pull", "t/b:v1")
    assert r.returncode == 4 and "malformed digest" in r.stderr
    r = run(cli_env, "verify", "--all")
    assert r.returncode == 4 and "t/b:v1" in r.stderr


def test_ls_glob_character_sets(cli_env: dict[str, str], tmp_path: Path) -> None:
    push_three(cli_env, tmp_path)

    def names(pattern: str) -> list[str]:
        r = run(cli_env, "ls", pattern, "--json")
        assert r.returncode == 0, r.stderr
        return [json.loads(line)["repository"] for line in r.stdout.splitlines()]

    assert names("t/[ab]") == ["t/a", "t/b"]
    assert names("t/[!ab]") == ["t/c"]
    assert names("[t]/?") == ["t/a", "t/b", "t/c"]
    assert names("t/[a-b]*") == ["t/a", "t/b"]


def test_audit_reports_missing_event_triggers(make_registry: RegistryFactory,
                                              catalog_url: str) -> None:
    Catalog.open(catalog_url, auto_upgrade=True).close()
    reg = make_registry(catalog_url=catalog_url)
    try:
        reg.push(HOSTILE / "good.kv", "t/audit:v1")
        assert reg.audit("t/audit:v1").ok
        engine = create_engine(catalog_url)
        with engine.begin() as conn:
            if engine.dialect.name == "sqlite":
                conn.execute(text("DROP TRIGGER events_append_only_delete"))
            else:
                conn.execute(text("ALTER TABLE events DISABLE TRIGGER events_append_only"))
                conn.execute(text("DROP TRIGGER events_append_only_truncate ON events"))
        engine.dispose()
        report = reg.audit("t/audit:v1")
        problems = [f for f in report.failures if "append-only trigger" in f]
        if catalog_url.startswith("sqlite"):
            assert len(problems) == 1 and "events_append_only_delete is missing" in problems[0]
        else:
            assert len(problems) == 2
            assert any("events_append_only is disabled" in p or
                       "events_append_only on the events table is disabled" in p
                       for p in problems)
        assert not report.ok
    finally:
        reg.close()


def test_audit_tells_to_record_the_chain_head(cli_env: dict[str, str]) -> None:
    assert run(cli_env, "push", str(HOSTILE / "good.kv"), "t/h:v1").returncode == 0
    r = run(cli_env, "audit", "t/h:v1")
    assert r.returncode == 0, r.stderr
    assert "record this head elsewhere" in r.stdout


@pytest.mark.parametrize("odd", ["pct%41home", "q?mode=ro", "hash#at@colon:x"])
def test_home_characters_stay_in_the_path(cli_env: dict[str, str], tmp_path: Path,
                                          odd: str) -> None:
    home = tmp_path / odd
    url = default_catalog_url(home)
    assert Config.from_env({"KVGRAFT_HOME": str(home)}).embedded
    env = dict(cli_env, KVGRAFT_HOME=str(home))
    r = run(env, "push", str(HOSTILE / "good.kv"), "t/home:v1")
    assert r.returncode == 0, r.stderr
    assert (home / "catalog.db").is_file(), url
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == [odd]
    assert run(env, "ls").returncode == 0

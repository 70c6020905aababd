"""Hostile user input: each case is one line on stderr, a typed exit code (never 1), and
nothing stored. The KV files are the committed fixtures in tests/data/hostile/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraft.blobstore import open_store
from kvgraft.catalog import Catalog
from kvgraft.errors import InvalidKVFile, UsageError
from kvgraft.strictjson import RejectedJSON, loads
from tests.support.harness import RegistryFactory
from tests.support.hostile import HOSTILE


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def one_line_error(r: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert needle in lines[0], lines[0]
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr


def stored_blobs(home: Path) -> list[Path]:
    return [p for p in (home / "blobs").rglob("*") if p.is_file()]


@pytest.mark.parametrize(("fixture", "needle"), [
    ("deep-nesting.kv", "nested"),
    ("huge-int-shape.kv", "digits"),
    ("config-not-object.kv", "model.config"),
    ("config-nan.kv", "NaN"),
    ("config-overflow.kv", "overflows"),
    ("lone-surrogate.kv", "lone surrogate"),
    ("start-superscript.kv", "layers.1.start"),
    ("start-arabic-digit.kv", "layers.1.start"),
    ("start-5000-digits.kv", "layers.1.start"),
    ("model-name-long.kv", "model.name"),
    ("model-name-nul.kv", "model.name"),
])
def test_hostile_kv_file_push_is_exit_4_and_stores_nothing(
        cli_env: dict[str, str], tmp_path: Path, fixture: str, needle: str) -> None:
    r = run(cli_env, "push", str(HOSTILE / fixture), "hostile/case:v1")
    one_line_error(r, 4, needle)
    assert stored_blobs(tmp_path / "home") == []


@pytest.mark.parametrize("fixture", ["model-name-long.kv", "model-name-nul.kv"])
def test_postgres_push_refuses_before_storing(make_registry: RegistryFactory, postgres_url: str,
                                              tmp_path: Path, fixture: str) -> None:
    """A name PostgreSQL would refuse (varchar(255), no NUL) is refused before any upload,
    so no orphan blobs are left behind."""
    Catalog.open(postgres_url, auto_upgrade=True).close()
    reg = make_registry(catalog_url=postgres_url)
    try:
        with pytest.raises(InvalidKVFile, match=r"model\.name"):
            reg.push(HOSTILE / fixture, "hostile/name:v1")
        with pytest.raises(UsageError, match="label"):
            reg.push(HOSTILE / "good.kv", "hostile/name:v1", labels={"k": "a\0b"})
        assert list(reg.store.iter()) == []
        assert reg.list() == ()
    finally:
        reg.close()


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["gc", "--grace", "99999999999d"], 2, "longer than 100 years"),
    (["gc", "--grace", "\u0663d"], 2, "not a duration"),
    (["gc", "--dry-run", "--untagged-older-than", "9" * 5000], 2, "not a duration"),
    (["log", "--since", "99999999999d"], 2, "longer than 100 years"),
    (["log", "--since", "0001-01-01"], 2, "out of range"),
    (["pull", "hostile/x:v1", "-o", ""], 2, "must name a file"),
    (["--store", "s3://bucket/team/../other", "gc", "--dry-run"], 2, "'..'"),
    (["--store", "memory://a/./b", "gc", "--dry-run"], 2, "segment"),
    (["push", str(HOSTILE / "good.kv"), "hostile/x:v1", "--label", "k=\udcff"], 2, "label"),
])
def test_hostile_arguments_are_usage_errors(cli_env: dict[str, str], args: list[str],
                                            code: int, needle: str) -> None:
    one_line_error(run(cli_env, *args), code, needle)


def test_binary_config_toml_is_usage_error(cli_env: dict[str, str], tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_bytes(b"\xff\xfe\x00binary\x82\x83")
    one_line_error(run(cli_env, "--remote", "team", "ls"), 2, "not UTF-8")
    one_line_error(run(cli_env, "remote", "ls"), 2, "not UTF-8")


def test_missing_blob_is_integrity_error_for_pull_and_verify(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    """One meaning: a blob the catalog references but the store lacks is lost data (4)."""
    r = run(cli_env, "push", str(HOSTILE / "good.kv"), "hostile/gone:v1")
    assert r.returncode == 0, r.stderr
    for blob in stored_blobs(tmp_path / "home"):
        blob.unlink()
    one_line_error(run(cli_env, "pull", "hostile/gone:v1"), 4, "missing from")
    r = run(cli_env, "verify", "--all")
    assert r.returncode == 4 and "missing from" in r.stderr
    one_line_error(run(cli_env, "pull", "hostile/never:v1"), 3, "hostile/never")


@pytest.mark.parametrize(("raw", "needle"), [
    ("[" * 100_000 + "]" * 100_000, "nested"),
    ("[" * 70 + "]" * 70, "nested"),
    ('{"a": NaN}', "NaN"),
    ("[Infinity]", "Infinity"),
    ("[1e999999]", "overflows"),
    ("[" + "7" * 5000 + "]", "digits"),
    ('["\\ud800"]', "lone surrogate"),
    ('{"\\udfff": 1}', "lone surrogate"),
    (b"\xff[]", "utf-8"),
    ("{", "Expecting"),
])
def test_strict_json_refuses(raw: str | bytes, needle: str) -> None:
    with pytest.raises(RejectedJSON, match=needle):
        loads(raw)


def test_strict_json_accepts_ordinary_documents() -> None:
    doc = {"a": [1, -2.5e-3, "\u00e9\U0001f600", None, True], "b": {"c": 10**18}}
    assert loads(json.dumps(doc)) == doc


def test_store_prefix_segments() -> None:
    for bad in ("s3://b/a/../c", "s3://b/./c", "s3://b/a//c", "memory://x/../y"):
        with pytest.raises(UsageError, match="segment"):
            open_store(bad)
    assert open_store("memory://team/kv").url.startswith("memory://")

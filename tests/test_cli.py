"""The command line: CliRunner for breadth, real subprocesses for exit codes and output."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvgraft.cli.main import cli
from tests.support.hostile import HOSTILE
from tests.support.synthetic import write_synthetic


def run(env: dict[str, str], *args: str,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args],
                          env=env, capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture
def runner(cli_env: dict[str, str]) -> CliRunner:
    return CliRunner(env=cli_env)


def test_push_pull_ls_inspect_tag_verify(runner: CliRunner, tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=700, window=100, sliding=[1])
    r = runner.invoke(cli, ["push", str(src), "demo/a:v1", "--label", "task=math",
                            "--chunk-tokens", "128", "--level", "3"])
    assert r.exit_code == 0, r.output
    digest = r.stdout.strip().splitlines()[-1]
    assert digest.startswith("sha256:")
    r = runner.invoke(cli, ["push", str(src), "demo/a:v1", "--chunk-tokens", "128", "--json"])
    assert json.loads(r.stdout)["blobs_stored"] == 0
    out = tmp_path / "out.kv"
    r = runner.invoke(cli, ["pull", "demo/a:v1", "--output", str(out)])
    assert r.exit_code == 0, r.output
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()
    r = runner.invoke(cli, ["pull", f"demo/a@{digest}", "--json"])
    assert json.loads(r.stdout)["fetched"] == 0
    r = runner.invoke(cli, ["ls", "--json"])
    assert [json.loads(line)["tag"] for line in r.stdout.splitlines()] == ["v1"]
    r = runner.invoke(cli, ["inspect", "demo/a:v1", "--json"])
    info = json.loads(r.stdout)
    assert info["digest"] == digest and info["labels"] == {"task": "math"}
    assert all({"size", "stored_size", "codec"} <= set(c) for c in info["chunks"])
    assert runner.invoke(cli, ["inspect", "demo/a:v1"]).exit_code == 0
    assert runner.invoke(cli, ["tag", "demo/a:v1", "demo/a:stable"]).exit_code == 0
    assert runner.invoke(cli, ["untag", "demo/a:v1"]).exit_code == 0
    r = runner.invoke(cli, ["ls"])
    assert "stable" in r.stdout and "v1" not in r.stdout
    r = runner.invoke(cli, ["verify", "--all", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"] is True
    r = runner.invoke(cli, ["db", "current", "--json"])
    assert json.loads(r.stdout)["up_to_date"] is True


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["pull", "no/such:tag"], 3, "not in the catalog"),
    (["inspect", "no/such"], 3, "not in the catalog"),
    (["untag", "no/such:x"], 3, "no tag"),
    (["pull", "Bad/Name"], 2, "invalid repository name"),
    (["pull", "../../etc/passwd"], 2, "invalid repository name"),
    (["pull", "a:" + "t" * 200], 2, "invalid tag"),
    (["pull", "a@sha256:1234"], 2, "not a sha256"),
    (["verify"], 2, "give a REF or --all"),
    (["push", "/nonexistent.kv", "a:b"], 2, "no such file"),
    (["push", str(HOSTILE / "truncated-data.kv"), "a:b"], 4, "not a valid KV file"),
    (["push", str(HOSTILE / "header-not-json.kv"), "a:b"], 4, "header is not JSON"),
    (["push", str(HOSTILE / "good.kv"), "a:b", "--label", "novalue"], 2, "key=value"),
    (["--store", "ftp://x/y", "push", str(HOSTILE / "good.kv"), "a:b"], 2, "unsupported blob"),
    (["--catalog", "mysql://x/y", "ls"], 2, "unsupported catalog"),
    (["push", str(HOSTILE / "good.kv"), "a:b", "--codec", "lzma"], 2, "Invalid value"),
])
def test_errors_are_one_line_with_exit_code(cli_env: dict[str, str], args: list[str],
                                            code: int, needle: str) -> None:
    r = run(cli_env, *args)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    if code != 2 or "Invalid value" not in needle:
        assert len(r.stderr.strip().splitlines()) <= 3


def test_corrupt_blob_exit_4_names_blob(cli_env: dict[str, str], tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=400)
    assert run(cli_env, "push", str(src), "demo/a").returncode == 0
    home = Path(cli_env["KVGRAFT_HOME"])
    info = json.loads(run(cli_env, "inspect", "demo/a", "--json").stdout)
    victim = info["chunks"][0]["digest"].split(":")[1]
    path = home / "blobs" / "sha256" / victim[:2] / victim[2:]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    r = run(cli_env, "verify", "demo/a")
    assert r.returncode == 4 and victim in r.stderr
    env = {**cli_env, "KVGRAFT_CACHE": str(tmp_path / "fresh-cache")}
    r = run(env, "pull", "demo/a", "-o", str(tmp_path / "o.kv"))
    assert r.returncode == 4 and victim in r.stderr and "Traceback" not in r.stderr


def test_directory_for_a_blob_in_the_local_store_exit_4_names_path(runner: CliRunner,
                                                              tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=400)
    assert runner.invoke(cli, ["push", str(src), "demo/a"]).exit_code == 0
    info = json.loads(runner.invoke(cli, ["inspect", "demo/a", "--json"]).stdout)
    victim = info["chunks"][0]["digest"].split(":")[1]
    assert runner.env is not None
    path = Path(str(runner.env["KVGRAFT_HOME"])) / "blobs" / "sha256" / victim[:2] / victim[2:]
    path.unlink()
    path.mkdir()  # no blob, whoever reads it: the store's data is damaged (exit 4)
    for args in (["verify", "demo/a"], ["pull", "demo/a", "-o", str(tmp_path / "o.kv")]):
        r = runner.invoke(cli, args)
        assert r.exit_code == 4, r.output
        assert f"{path} is a directory, not a regular file" in r.stderr
        assert "Traceback" not in r.stderr


def test_debug_shows_traceback(cli_env: dict[str, str]) -> None:
    r = run({**cli_env, "KVGRAFT_DEBUG": "1"}, "pull", "no/such")
    assert r.returncode == 3 and "Traceback" in r.stderr


def test_pull_in_a_separate_process_is_byte_identical(cli_env: dict[str, str],
                                                      tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=500, dtype="F16")
    pushed = run(cli_env, "push", str(src), "demo/x:1")
    assert pushed.returncode == 0, pushed.stderr
    other = tmp_path / "elsewhere"
    other.mkdir()
    r = run(cli_env, "pull", "demo/x:1", "--output", "copy.kv", cwd=other)
    assert r.returncode == 0, r.stderr
    assert (other / "copy.kv").read_bytes() == src.read_bytes()
    assert r.stdout.strip() == pushed.stdout.strip()

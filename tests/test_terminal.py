"""Stored strings are someone else's input: human output escapes what could drive a
terminal (CSI, OSC, bidi overrides) and rich markup; JSON output keeps them exact."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvgraft.cli.output import emit_table, safe
from tests.support.hostile import HOSTILE

HOSTILE_TEXT = "\x1b[2J\x1b]0;owned\x07\x9b31m[bold]x[/]\u202egnp.exe\r\n"
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\r")


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_safe_escapes_controls_and_keeps_text() -> None:
    out = safe(HOSTILE_TEXT)
    assert not any(c in out for c in RAW) and "\n" not in out
    assert out.startswith("\\x1b[2J\\x1b]0;owned\\x07")
    assert "\\u202e" in out
    assert safe("caf\u00e9 \u65e5\u672c m/a:v1 [x]") == "caf\u00e9 \u65e5\u672c m/a:v1 [x]"


def test_table_cells_are_not_markup(capsys: pytest.CaptureFixture[str]) -> None:
    emit_table(["A"], [["[/]"], ["[bold]x[/bold]"], [HOSTILE_TEXT]])
    out = capsys.readouterr().out
    assert "[/]" in out and "[bold]x[/bold]" in out
    assert not any(c in out for c in RAW)


@pytest.mark.slow
def test_commands_escape_stored_strings(cli_env: dict[str, str]) -> None:
    # The actor comes from $USER: another stored string a hostile user controls.
    env = dict(cli_env, USER="mallory" + HOSTILE_TEXT, LOGNAME="mallory" + HOSTILE_TEXT)
    r = run(env, "push", str(HOSTILE / "good.kv"), "term/a:v1", "--label",
            "note=" + HOSTILE_TEXT)
    assert r.returncode == 0, r.stderr
    for args in (["inspect", "term/a:v1"], ["ls"], ["log"], ["audit", "term/a:v1"],
                 ["untag", "term/missing:v9"]):
        r = run(env, *args)
        assert r.returncode in (0, 3), (args, r.stderr)
        for stream in (r.stdout, r.stderr):
            assert not any(c in stream for c in RAW), (args, stream)
    r = run(env, "inspect", "term/a:v1", "--json")
    assert json.loads(r.stdout)["labels"]["note"] == HOSTILE_TEXT
    r = run(env, "log", "--json")
    assert json.loads(r.stdout.splitlines()[0])["actor"].startswith("mallory" + HOSTILE_TEXT)

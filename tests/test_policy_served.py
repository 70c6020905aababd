"""The [policy] of config.toml holds through a `kvgraft serve` remote on every command that
hands KV onward (pull, check, graft, match, verify-graft), exactly as it does on a direct
remote: each opens the artifact through Registry.open, whatever the remote."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="grafting tests need the [hf] extra (torch)")
pytest.importorskip("transformers", reason="grafting tests need the [hf] extra (transformers)")

from click.testing import CliRunner, Result  # noqa: E402

from kvgraft.cli.main import cli  # noqa: E402
from tests.support.serve import kvgraft, make_token, running_server, server_env  # noqa: E402
from tests.support.tinymodels import build  # noqa: E402

TEXT = "Keep the light burning from sunset to sunrise, in every weather. "
REF = "team/doc:v1"
HUB = ["--remote", "hub"]


@dataclass(frozen=True)
class Node:
    env: dict[str, str]
    home: Path
    model: Path
    runner: CliRunner

    def invoke(self, *args: str) -> Result:
        return self.runner.invoke(cli, [*HUB, *args])

    def policy(self, text: str | None) -> None:
        path = self.home / "config.toml"
        kept = path.read_text().split("[policy]")[0]
        path.write_text(kept if text is None else f"{kept}\n[policy]\n{text}\n")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A server holding an unsigned, unverified graft as REF, and a node reaching it as
    the remote `hub`, with a trusted key `alice` of its own."""
    root = tmp_path_factory.mktemp("served-policy")
    model = build(root / "llama", "llama")
    env = server_env(root / "server")
    token = make_token(env, "team", "repository:team/*:pull,push")
    (root / "team.token").write_text(token + "\n")
    node_env = server_env(root / "node")
    with running_server(env, root / "server.log") as server:
        kvgraft(node_env, "remote", "add", "hub", server.url, "--token-file",
                str(root / "team.token"))
        kvgraft(node_env, "key", "generate", "alice")
        n = Node(node_env, Path(node_env["KVGRAFT_HOME"]), model, CliRunner(env=node_env))
        r = n.invoke("capture", REF, "--model", str(model), "--text", TEXT, "--json")
        assert r.exit_code == 0, r.output
        yield n
        n.policy(None)


def commands(model: Path, out: Path) -> dict[str, list[str]]:
    m = ["--model", str(model)]
    return {
        "pull": ["pull", REF, "--output", str(out)],
        "check": ["check", REF, *m],
        "graft": ["graft", REF, *m, "--text", TEXT + "And", "--max-new-tokens", "1"],
        "match": ["match", *m, "--text", TEXT + "And then"],
        "verify-graft": ["verify-graft", REF, *m, "--steps", "1"],
    }


def refused(r: Result, why: str) -> None:
    assert r.exit_code == 4, r.output
    assert why in r.output, r.output


def refusals(node: Node) -> set[str]:
    r = node.invoke("log", REF, "--json")
    assert r.exit_code == 0, r.output
    events = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    return {e["action"] for e in events if e["outcome"] == "refused"}


def test_require_verified_from_config_holds_through_the_server(node: Node,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "out.kv"
    cmds = commands(node.model, out)
    node.policy("require_verified = true")
    try:
        for name in ("pull", "check", "graft", "match"):
            refused(node.invoke(*cmds[name]), "never verified")
            assert not out.exists(), name
    finally:
        node.policy(None)
    assert refusals(node) >= {"pull", "check", "load", "match"}
    # The same commands without the policy: what refused them was the policy alone.
    for name in ("pull", "check", "match"):
        r = node.invoke(*cmds[name])
        assert r.exit_code == 0, (name, r.output)
    assert out.is_file()


def test_require_signed_by_from_config_holds_through_the_server(node: Node,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "out.kv"
    node.policy('require_signed_by = ["alice"]')
    try:
        for name, args in commands(node.model, out).items():
            refused(node.invoke(*args), "it is not signed")
            assert not out.exists(), name
    finally:
        node.policy(None)
    assert refusals(node) >= {"pull", "check", "load", "match"}  # graft, verify-graft: load

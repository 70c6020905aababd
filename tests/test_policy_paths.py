"""The policy on every path that hands KV to a model: pull, load_graft, match, check, graft
and verify-graft all open artifacts through Registry.open, so an unsigned or unverified
graft is refused (PolicyRefused, exit 4) by each of them, from a flag or from config.toml."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="grafting tests need the [hf] extra (torch)")
pytest.importorskip("transformers", reason="grafting tests need the [hf] extra (transformers)")

from click.testing import CliRunner, Result  # noqa: E402

from kvgraft.cli.main import cli  # noqa: E402
from kvgraft.client import Registry  # noqa: E402
from kvgraft.config import Config  # noqa: E402
from kvgraft.integrations.transformers import (  # noqa: E402
    LoadedModel,
    capture,
    load_graft,
    load_model,
)
from kvgraft.provenance import PolicyRefused  # noqa: E402
from kvgraft.services.match import match  # noqa: E402
from kvgraft.transfer.push import PushOptions  # noqa: E402
from tests.support.tinymodels import build  # noqa: E402

TEXT = "Keep the light burning from sunset to sunrise, in every weather. "
REF = "t/doc:v1"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("models") / "llama", "llama")


@pytest.fixture
def setup(cli_env: dict[str, str], model_path: Path,
          tmp_path: Path) -> tuple[Registry, LoadedModel, CliRunner]:
    """An unsigned, unverified graft pushed as REF, a trusted key `alice`, and a runner
    on the same home."""
    reg = Registry(Config.from_env(cli_env))
    lm = load_model(model_path, cache_dir=reg.config.cache_dir)
    kv = capture(lm, tmp_path / "doc.kv", text=TEXT)
    reg.push(kv.path, REF, options=PushOptions(chunk_tokens=32))
    reg.keyring.generate("alice")
    return reg, lm, CliRunner(env=cli_env)


def policy(reg: Registry, text: str) -> None:
    (reg.config.home / "config.toml").write_text(f"[policy]\n{text}\n")


def commands(model: Path, out: Path) -> dict[str, list[str]]:
    m = ["--model", str(model)]
    return {
        "pull": ["pull", REF, "--output", str(out)],
        "check": ["check", REF, *m],
        "graft": ["graft", REF, *m, "--text", TEXT + "And", "--max-new-tokens", "1"],
        "verify-graft": ["verify-graft", REF, *m, "--steps", "1"],
        "match": ["match", *m, "--text", TEXT + "And then"],
    }


def refused(r: Result, why: str) -> None:
    assert r.exit_code == 4, r.output
    assert why in r.output, r.output


@pytest.mark.parametrize("source", ["flag", "config"])
def test_unsigned_graft_is_refused_by_every_command(
        setup: tuple[Registry, LoadedModel, CliRunner], model_path: Path, tmp_path: Path,
        source: str) -> None:
    reg, lm, runner = setup
    flag = ["--require-signed-by", "alice"] if source == "flag" else []
    if source == "config":
        policy(reg, 'require_signed_by = ["alice"]')
    out = tmp_path / "out.kv"
    for name, args in commands(model_path, out).items():
        refused(runner.invoke(cli, [*args, *flag]), "it is not signed")
        assert not out.exists(), name
    # The library paths refuse it too.
    with pytest.raises(PolicyRefused, match="not signed"):
        load_graft(REF, lm, registry=reg, require_signed_by=("alice",))
    with pytest.raises(PolicyRefused, match="not signed"):
        reg.open(REF, require_signed_by=("alice",))
    with pytest.raises(PolicyRefused, match="not signed"):
        match(reg, lm.fingerprint.identity, lm.tokenizer(TEXT + "x")["input_ids"],
              require_signed_by=("alice",))
    refusals = [e for e in reg.log(REF) if e.outcome == "refused"]
    assert {e.action for e in refusals} >= {"pull", "check", "load", "match"}

    # Once signed by alice, every command accepts it.
    reg.sign(REF, "alice")
    for name, args in commands(model_path, out).items():
        r = runner.invoke(cli, [*args, *flag])
        assert r.exit_code == 0, (name, r.output)
    assert out.is_file()


def test_unverified_graft_is_refused_where_a_verification_is_required(
        setup: tuple[Registry, LoadedModel, CliRunner], model_path: Path, tmp_path: Path,
        ) -> None:
    reg, lm, runner = setup
    cmds = commands(model_path, tmp_path / "out.kv")
    guarded = ["pull", "check", "graft", "match"]
    for name in guarded:
        refused(runner.invoke(cli, [*cmds[name], "--require-verified"]), "never verified")
    policy(reg, "require_verified = true")
    for name in guarded:
        refused(runner.invoke(cli, cmds[name]), "never verified")
    with pytest.raises(PolicyRefused, match="never verified"):
        load_graft(REF, lm, registry=reg)
    # verify-graft is what produces the verification: the policy cannot ask it first.
    r = runner.invoke(cli, cmds["verify-graft"])
    assert r.exit_code == 0, r.output
    for name in guarded:
        r = runner.invoke(cli, cmds[name])
        assert r.exit_code == 0, (name, r.output)
    assert load_graft(REF, lm, registry=reg).token_count > 0


def test_check_policy_is_public_and_takes_a_digest(
        setup: tuple[Registry, LoadedModel, CliRunner]) -> None:
    reg, _, _ = setup
    opened = reg.open(REF)
    reg.check_policy(opened.digest, opened.manifest)  # no policy: accepted
    policy(reg, 'require_signed_by = ["alice"]')
    with pytest.raises(PolicyRefused, match="not signed"):
        reg.check_policy(opened.digest, opened.manifest)
    with pytest.raises(PolicyRefused):
        reg.open(opened.digest)

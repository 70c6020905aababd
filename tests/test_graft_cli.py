"""What the model commands tell a user: the references `match` found, and the model name
recorded for the built-in `smollm2`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="grafting tests need the [hf] extra (torch)")
pytest.importorskip("transformers", reason="grafting tests need the [hf] extra (transformers)")

from click.testing import CliRunner  # noqa: E402

from kvgraft.cli.main import cli  # noqa: E402
from kvgraft.client import Registry  # noqa: E402
from kvgraft.config import Config  # noqa: E402
from kvgraft.integrations.transformers import load_model  # noqa: E402
from kvgraft.integrations.transformers import models as hf_models  # noqa: E402
from tests.support.tinymodels import build  # noqa: E402

TEXT = "Keep the light burning from sunset to sunrise. "


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("models") / "llama", "llama")


def test_match_names_the_references_of_the_artifact(cli_env: dict[str, str],
                                                     model_path: Path) -> None:
    runner = CliRunner(env=cli_env)
    m = ["--model", str(model_path)]
    # Shorter than one chunk (256 tokens): found for a prompt that extends it.
    r = runner.invoke(cli, ["capture", "docs/a:v1", *m, "--text", TEXT, "--json"])
    assert r.exit_code == 0, r.output
    digest = json.loads(r.stdout)["digest"]
    assert runner.invoke(cli, ["tag", "docs/a:v1", "docs/a:stable"]).exit_code == 0
    r = runner.invoke(cli, ["match", *m, "--text", TEXT + "And then?", "--json"])
    assert r.exit_code == 0, r.output
    found = json.loads(r.stdout)["match"]
    assert found["digest"] == digest and found["length"] == found["token_count"] > 0
    assert sorted(found["references"]) == ["docs/a:stable", "docs/a:v1"]
    r = runner.invoke(cli, ["match", *m, "--text", TEXT + "And then?"])
    assert r.exit_code == 0 and "docs/a:stable, docs/a:v1" in r.stdout, r.output
    r = runner.invoke(cli, ["match", *m, "--text", "Something else entirely", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["match"] is None


def test_smollm2_records_its_published_name(cli_env: dict[str, str], model_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The converted SmolLM2 directory lives in the cache; a small model stands in for it so
    # that the test needs no GGUF conversion. What is checked is the name kvgraft records.
    monkeypatch.setattr(hf_models, "smollm2_dir", lambda cache_dir, dtype="BF16": model_path)
    reg = Registry(Config.from_env(cli_env))
    lm = load_model("smollm2", cache_dir=reg.config.cache_dir)
    assert lm.fingerprint.name == hf_models.SMOLLM2_NAME
    runner = CliRunner(env=cli_env)
    r = runner.invoke(cli, ["fingerprint", "--model", "smollm2", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["name"] == hf_models.SMOLLM2_NAME
    r = runner.invoke(cli, ["capture", "s/doc:v1", "--model", "smollm2", "--text", TEXT])
    assert r.exit_code == 0, r.output
    assert reg.inspect("s/doc:v1").manifest.model_name == hf_models.SMOLLM2_NAME
    # A model directory keeps the name its config gives (here its path).
    assert load_model(model_path, cache_dir=reg.config.cache_dir).fingerprint.name == \
        str(model_path)

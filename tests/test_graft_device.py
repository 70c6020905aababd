"""The device a model runs on: `--device` through capture, push, a pull on another machine,
graft and verify-graft (here the CPU, named explicitly: the path a GPU takes), the staging
copy to a device, and a device this machine lacks refused as a usage error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="grafting tests need the [hf] extra (torch)")
pytest.importorskip("transformers", reason="grafting tests need the [hf] extra (transformers)")

from click.testing import CliRunner  # noqa: E402

from kvgraft.cli.main import cli  # noqa: E402
from kvgraft.config import default_catalog_url  # noqa: E402
from kvgraft.errors import UsageError  # noqa: E402
from kvgraft.integrations.transformers.device import resolve_device, to_device  # noqa: E402
from tests.support.tinymodels import build  # noqa: E402

TEXT = "Keep the light burning from sunset to sunrise, in every weather. " * 3
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("models") / "llama-bf16", "llama", dtype="BF16")


def kvgraft(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # two processes that load torch
def test_named_device_from_capture_to_verify_on_another_machine(
        cli_env: dict[str, str], model_path: Path, tmp_path: Path) -> None:
    model = ["--model", str(model_path), "--device", "cpu", "--threads", "1"]
    r = CliRunner(env=cli_env).invoke(cli, ["capture", "docs/manual:v1", *model,
                                            "--text", TEXT, "--chunk-tokens", "64", "--json"])
    assert r.exit_code == 0, r.output
    digest = json.loads(r.stdout)["digest"]
    # Machine b: its own home and an empty cache, the catalog and the store shared.
    a = tmp_path / "home"
    b = {**cli_env, "KVGRAFT_HOME": str(tmp_path / "b" / "home"),
         "KVGRAFT_CACHE": str(tmp_path / "b" / "cache"),
         "KVGRAFT_CATALOG_URL": default_catalog_url(a),
         "KVGRAFT_BLOB_URL": (a / "blobs").as_uri()}
    p = kvgraft(b, "verify-graft", "docs/manual:v1", *model, "--recompute", "--steps", "3",
                "--json")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["digest"] == digest and report["byte_identical"] is True
    assert report["recompute"]["ok"] and report["recompute"]["mismatches"] == []
    assert report["engine"]["device"] == "cpu"
    p = kvgraft(b, "graft", "docs/manual:v1", *model, "--text", TEXT + "Then",
                "--max-new-tokens", "4", "--json")
    assert p.returncode == 0, p.stderr
    grafted = json.loads(p.stdout)
    assert grafted["digest"] == digest and grafted["reused_tokens"] == report["prefix_tokens"]


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
@pytest.mark.parametrize("command", [
    ["capture", "docs/x:v1", "--text", "hi"],
    ["graft", "docs/x:v1", "--text", "hi"],
    ["verify-graft", "docs/x:v1"],
])
def test_cuda_without_a_gpu_is_a_usage_error(cli_env: dict[str, str], model_path: Path,
                                              command: list[str]) -> None:
    r = CliRunner(env=cli_env).invoke(cli, [*command, "--model", str(model_path),
                                            "--device", "cuda"])
    assert r.exit_code == 2, r.output
    assert "device 'cuda' asked for" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize(("args", "words"), [
    (["--model", "m.gguf", "--device", "cpu"], "not a GGUF file"),
    (["--engine", "vllm", "--device", "cpu"], "not --engine vllm"),
])
def test_device_applies_to_transformers_only(cli_env: dict[str, str], model_path: Path,
                                             args: list[str], words: str) -> None:
    model = [] if "--model" in args else ["--model", str(model_path)]
    r = CliRunner(env=cli_env).invoke(cli, ["verify-graft", "docs/x:v1", *model, *args])
    assert r.exit_code == 2 and words in r.output, r.output


def test_resolve_device() -> None:
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    for bad in ["tpu", "cuda:x", "cpu:1", "", "cuda:-1"]:
        with pytest.raises(UsageError):
            resolve_device(bad)
    if NO_CUDA:
        with pytest.raises(UsageError, match="cuda:1"):
            resolve_device("cuda:1")
    else:
        with pytest.raises(UsageError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("stage", [1, 7, 64, 1 << 20])
def test_staged_copy_moves_every_byte(stage: int) -> None:
    data = bytearray(torch.randint(0, 256, (1000,), dtype=torch.uint8).numpy().tobytes())
    spans = [(0, 10), (10, 0), (17, 500), (999, 1), (3, 997)]
    out = to_device(data, spans, "cpu", stage_bytes=stage, pin=False)
    assert [bytes(t.numpy()) for t in out] == [bytes(data[b:b + n]) for b, n in spans]
    data[20] ^= 0xFF  # copies, not views of the host buffer
    assert bytes(out[2].numpy()) != bytes(data[17:517])

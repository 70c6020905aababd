"""benchmarks/gpu.py runs on the CPU too (tiny model, 512 tokens), so the command a GPU
machine runs in its one short lease cannot rot between leases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the GPU benchmark needs the [hf] extra (torch)")
pytest.importorskip("transformers", reason="the GPU benchmark needs the [hf] extra")

from benchmarks import gpu

ROOT = Path(__file__).resolve().parent.parent


def check_size(row: dict[str, Any]) -> None:
    assert row["tokens"] == 512 and row["kv_bytes"] > 0
    fid = row["fidelity"]
    assert fid["byte_identical"] and fid["recompute_ok"] and fid["greedy_identical"]
    assert fid["graft_tokens"] == fid["fresh_tokens"] and fid["tensors_checked"] == 4
    stages = row["stages"]
    for key in ["read_store_gbps", "decode_gbps", "verify_gbps", "cold_read_gbps",
                "read_machine_cache_gbps", "warm_read_verify_gbps",
                "copy_pinned_staged_gbps", "copy_pageable_gbps"]:
        assert stages[key] > 0, key
    assert stages["copied_bytes"] == 512 * 256  # 2 layers, 2 KV heads of 16, K and V, bf16
    assert row["restore"]["warm_gbps"] > 0 and row["restore"]["cold_gbps"] > 0
    ttft = row["ttft"]
    assert ttft["prefill_s"] > 0 and ttft["graft_warm_s"] > 0 and ttft["graft_cold_s"] > 0
    assert ttft["first_tokens"]["graft_warm"] == ttft["first_tokens"]["graft_cold"]


def test_benchmark_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    code = gpu.main(["--out", str(out), "--device", "cpu", "--small", "--tokens", "512",
                     "--reps", "1", "--steps", "2", "--workers", "2", "--no-cli"])
    assert code == 0
    results = json.loads(out.read_text())
    assert results["ok"] is True and "cli" not in results
    assert results["env"]["device"] == "cpu" and results["env"]["model"] == "llama"
    assert results["model"]["kv_bytes_per_token"] == 256
    ceilings = results["ceilings"]
    assert ceilings["sha256_all_gbps"] > 0 and "h2d_pinned_gbps" not in ceilings
    [row] = results["sizes"]
    check_size(row)


@pytest.mark.slow  # the device command as it is, three more processes that load torch
def test_device_command_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--out", str(out),
                        "--device", "cpu", "--small", "--tokens", "512", "--reps", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(out.read_text())
    assert json.loads(p.stdout.splitlines()[-1])["ok"] is True
    cli = results["cli"]
    assert cli["ok"] and cli["verify_graft"]["device"] == "cpu"
    assert cli["graft"]["reused_tokens"] == cli["capture"]["token_count"] == 512
    check_size(results["sizes"][0])


def test_unknown_device_is_refused(tmp_path: Path) -> None:
    from kvgraft.errors import UsageError

    with pytest.raises(UsageError):
        gpu.main(["--out", str(tmp_path / "x.json"), "--device", "tpu", "--small"])

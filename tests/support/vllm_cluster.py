"""The vLLM tests' cluster: nodes are processes (support/vllm_node.py), each with its own
KVGRAFT_HOME and machine cache, sharing one catalog and one bucket. The fixtures that start
it (`cluster`, `world`) are in conftest.py; node A of `world` publishes Q1 and Q2.

The nodes restore with `restore_when = "always"` unless a test says otherwise: their tiny
models compute a prompt faster than any store answers, and these tests are about what a
restore does (tests/test_restore_pays.py is about when one pays)."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgraft.client import Registry
from kvgraft.config import Config
from kvgraft.digest import Digest
from tests.support.tinymodels import build

ROOT = Path(__file__).resolve().parent.parent.parent
PROMPT = 300  # tokens: one 256-token chunk is published, 256 are restorable
REPO = "test/vllm"
BLOCK = 128  # vLLM's CPU block size
NODE_TIMEOUT = 600
SPEC_ARG_MAX = 64 * 1024


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(PROMPT)]


Q1, Q2, Q3 = prompt(1), prompt(2), prompt(3)


def node_model(path: Path, seed: int) -> Path:
    # head_dim 64: the smallest head size vLLM's CPU attention accepts
    return build(path, "llama", dtype="BF16", seed=seed, head_dim=64, hidden_size=256,
                 intermediate_size=512)


def node_env(shared: dict[str, str], node: Path) -> dict[str, str]:
    return {**shared, "KVGRAFT_HOME": str(node / "home"), "KVGRAFT_CACHE": str(node / "cache"),
            "VLLM_CPU_KVCACHE_SPACE": "1"}


def run_node(model: Path, env: dict[str, str], prompts: Sequence[list[int] | dict[str, Any]],
             **options: Any) -> list[dict[str, Any]]:
    spec = {"model": str(model), "env": env, "prompts": prompts,
            "extra": {"repository": REPO, "restore_when": "always"}, **options}
    arg = json.dumps(spec)
    if len(arg) > SPEC_ARG_MAX:  # one argument holds at most 128 KiB on Linux
        path = Path(env["KVGRAFT_HOME"]).parent / "spec.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(arg)
        arg = f"@{path}"
    proc = subprocess.run([sys.executable, "-m", "tests.support.vllm_node", arg],
                          cwd=ROOT, capture_output=True, text=True, timeout=NODE_TIMEOUT)
    # vLLM logs (the connector's lines included) to stdout
    log = Path(env["KVGRAFT_HOME"]).parent / "node.log"
    log.parent.mkdir(parents=True, exist_ok=True)  # a node that failed early made none
    log.write_text(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVGRAFT-RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result: list[dict[str, Any]] = json.loads(lines[-1].split(" ", 1)[1])
    return result


def inspector(world: dict[str, Any], name: str = "inspector") -> Registry:
    """A registry on the cluster's catalog and bucket, with a home of its own."""
    shared, home = world["shared"], world["root"] / name
    return Registry(Config(home=home, catalog_url=shared["KVGRAFT_CATALOG_URL"],
                           blob_url=shared["KVGRAFT_BLOB_URL"], cache_dir=home / "cache"))


def published(reg: Registry, ids: list[int]) -> Digest:
    """The graft node A published for the first 256 tokens of ids."""
    tag = "t-" + Digest.of(struct.pack(f"<{256}q", *ids[:256])).hex[:32]
    return reg.resolve(f"{REPO}:{tag}")


def scheduler_side(model: Path, extra: dict[str, Any]) -> Any:
    """vLLM's scheduler-side connector for `model`, built from a real VllmConfig without
    starting an engine (what vLLM's scheduler constructs)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvgraft.integrations.vllm import KvgraftConnector

    config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=1024, enforce_eager=True),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvgraftConnector", kv_role="kv_both",
            kv_connector_module_path="kvgraft.integrations.vllm",
            kv_connector_extra_config={"repository": REPO, "restore_when": "always",
                                       **extra}))
    return KvgraftConnector(config, KVConnectorRole.SCHEDULER)


def vllm_request(rid: str, ids: list[int]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, ids, SamplingParams(max_tokens=1), None)


def answer(conn: Any, request: Any, limit: float = 30.0) -> tuple[int | None, float]:
    """Poll as vLLM's scheduler does (once a step) until the connector answers."""
    t0 = time.monotonic()
    while True:
        n, load_async = conn.get_num_new_matched_tokens(request, 0)
        assert load_async is False
        if n is not None or time.monotonic() - t0 > limit:
            return n, time.monotonic() - t0
        time.sleep(0.001)

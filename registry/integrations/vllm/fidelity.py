"""The fidelity check on vLLM (`kvgraft verify-graft --engine vllm`).

One engine process runs the graft's model with the kvgraft connector and computes the same
prompt (the graft's tokens, then a suffix) twice, generating greedily with the log-probs of
the whole vocabulary at every step:

  reference: the prefix computed by this vLLM (one request), then the prompt, its prefix
             from vLLM's own prefix cache (the two-step reference on this engine);
  graft:     vLLM's prefix cache emptied, the graft put in the engine's registry, the prompt
             again: the connector restores the graft into the blocks and vLLM computes the rest.

The engine's registry is a private one (a temporary catalog and store holding only the
graft under test): during the reference the connector finds nothing, so vLLM computes
everything itself, and during the graft run it can restore nothing but this artifact.

On the same engine (a graft vLLM published with the same vLLM, backend, block size and
model) the claim is exactness: equal greedy tokens and bit-equal log-probs at every step.
A graft captured by another engine (transformers) is restored only when asked
(`allow_cross_engine`); that run measures argmax agreement and KL and is never called exact.
The result is stored as the fidelity attestation the transformers check stores (the same
predicate type), for the identity of the model as this engine serves it.

vLLM spawns processes, so the engine runs as `python -m kvgraft.integrations.vllm.fidelity`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvgraft import __version__
from kvgraft.catalog.records import PushRecord
from kvgraft.client import Registry
from kvgraft.config import Config, default_catalog_url
from kvgraft.digest import Digest
from kvgraft.errors import IncompatibleModel, IntegrityError, RegistryError, UsageError
from kvgraft.formats.manifest import Manifest
from kvgraft.identity.fingerprint import architecture_digest, fingerprint_dir
from kvgraft.identity.model import ModelIdentity
from kvgraft.integrations.vllm.identity import EngineIdentity, engine_identity
from kvgraft.provenance.statement import fidelity_statement
from kvgraft.reference import Reference
from kvgraft.transfer.copy import copy_blobs

ATTENTION_BACKEND = "CPU_ATTN"  # the backend the connector serves (and names in identities)
STAGED = Reference("fidelity/graft", tag="check")  # the graft's name in the engine's registry
RESULT = "KVGRAFT-FIDELITY "
ENGINE_TIMEOUT = 3600.0
_VLLM_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
SAME, CROSS = "same-engine", "cross-engine"


@dataclass(frozen=True, slots=True)
class Step:
    """One greedy step of both runs, compared over the whole vocabulary."""

    index: int
    graft_token: int
    reference_token: int
    graft_logprob: float  # of the token each run chose
    reference_logprob: float
    identical: bool  # the full log-prob vectors are bit-equal
    max_abs_diff: float  # over the vocabulary
    kl: float  # KL(reference || graft), nats

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class VllmFidelityReport:
    reference: Reference
    digest: Digest
    mode: str  # SAME or CROSS
    prefix_tokens: int
    suffix_tokens: tuple[int, ...]
    restored_tokens: int  # by the connector in the graft run
    reference_cached: int  # from vLLM's own prefix cache in the reference run
    steps: tuple[Step, ...]
    engine: Mapping[str, Any]
    model: ModelIdentity  # the model as this engine serves it
    restore_failures: tuple[str, ...] = ()
    attestation: int | None = None
    timings: Mapping[str, float] = field(default_factory=dict)

    @property
    def tokens_equal(self) -> bool:
        return all(s.graft_token == s.reference_token for s in self.steps)

    @property
    def byte_exact(self) -> bool:
        """Only ever claimed on the same engine, for a restore of the same span."""
        return (self.mode == SAME and self.restored_tokens > 0
                and self.restored_tokens == self.reference_cached and self.tokens_equal
                and all(s.identical for s in self.steps))

    @property
    def ok(self) -> bool:
        """Same engine: exact. Cross engine: measured (a restore happened); never exact."""
        return self.byte_exact if self.mode == SAME else self.restored_tokens > 0

    def summary(self) -> dict[str, Any]:
        n = len(self.steps)
        return {
            "mode": self.mode, "byte_exact": self.byte_exact, "ok": self.ok,
            "restored_tokens": self.restored_tokens, "reference_cached": self.reference_cached,
            "steps": n, "greedy_identical": self.tokens_equal,
            "identical_steps": sum(s.identical for s in self.steps),
            "argmax_agreement": (sum(s.graft_token == s.reference_token for s in self.steps)
                                 / n if n else 1.0),
            "max_kl": max((s.kl for s in self.steps), default=0.0),
            "mean_kl": sum(s.kl for s in self.steps) / n if n else 0.0,
            "max_abs_diff": max((s.max_abs_diff for s in self.steps), default=0.0),
            "max_logprob_diff": max((abs(s.graft_logprob - s.reference_logprob)
                                     for s in self.steps), default=0.0),
            "restore_failures": list(self.restore_failures)}

    def to_json(self) -> dict[str, Any]:
        return {"reference": str(self.reference), "digest": str(self.digest),
                "engine": dict(self.engine), "model": self.model.to_json(),
                "prefix_tokens": self.prefix_tokens, "suffix_tokens": list(self.suffix_tokens),
                **self.summary(), "graft_continuation": [s.graft_token for s in self.steps],
                "reference_continuation": [s.reference_token for s in self.steps],
                "attestation": self.attestation, "timings": dict(self.timings),
                "detail": [s.to_json() for s in self.steps]}


# --- the parent side: identity, staging, the attestation -----------------------------------

def _mismatches(manifest: Manifest, fp: Any, cross: bool) -> list[str]:
    """How the graft's model differs from the live model directory (engine aside: that
    part is checked against the running engine)."""
    want = manifest.model
    out = [f"{f} differs (graft {getattr(want, f)}, model {getattr(fp.identity, f)})"
           for f in ("tokenizer", "weights") if getattr(want, f) != getattr(fp.identity, f)]
    engine = manifest.model_config.get("engine")
    arch = (fp.identity.architecture if cross
            else architecture_digest({**fp.config, "engine": engine}))
    if want.architecture != arch:
        out.append("architecture differs (the model's configuration is not the graft's)")
    return out


def graft_engine(manifest: Manifest) -> str:
    engine = manifest.model_config.get("engine")
    if isinstance(engine, Mapping):
        return str(engine.get("name", "unknown"))
    made = manifest.provenance.get("engine")
    return str(made.get("name", "transformers")) if isinstance(made, Mapping) else "transformers"


def _configs(root: Path, cache: Path) -> tuple[Config, Config]:
    """A private registry to hold only the graft (`stage`), and the empty one the engine's
    connector reads (`engine`; the graft is copied in between the two runs). Both store
    blobs in one temporary directory; the machine cache is the user's (verified reads)."""
    blobs = (root / "blobs").absolute().as_uri()
    stage, engine = (Config(root / n, default_catalog_url(root / n), blobs, cache)
                     for n in ("stage", "engine"))
    return stage, engine


def _stage(registry: Registry, manifest: Manifest, stage: Config) -> None:
    reg = Registry(stage)
    try:
        stats = copy_blobs(manifest, registry.store, reg.store)
        reg.transfers.commit(PushRecord(
            manifest, stats.blobs, STAGED.name, STAGED.tag, {},
            reg.events.event("copy", repository=STAGED.name, tag=STAGED.tag,
                             digest=manifest.digest, detail={"purpose": "fidelity check"})),
            lambda: copy_blobs(manifest, registry.store, reg.store).blobs)
    finally:
        reg.close()


def _config_json(c: Config) -> dict[str, str]:
    return {"home": str(c.home), "catalog_url": c.catalog_url, "blob_url": c.blob_url,
            "cache_dir": str(c.cache_dir)}


def _run_engine(spec: Mapping[str, Any], log: Path) -> dict[str, Any]:
    # KVGRAFT_* of the caller (a remote, offline mode) must not steer the engine's registry
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with log.open("wb") as out:
        proc = subprocess.run([sys.executable, "-m", "kvgraft.integrations.vllm.fidelity",
                               json.dumps(spec)], stdout=subprocess.PIPE, stderr=out,
                              env=env, timeout=ENGINE_TIMEOUT, check=False)
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith(RESULT)]
    if not lines:
        tail = log.read_text(errors="replace")[-2000:]
        raise RegistryError(f"the vLLM engine failed (exit {proc.returncode}): {tail}")
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT):])
    if "error" in result:
        kinds = {"IncompatibleModel": IncompatibleModel, "UsageError": UsageError,
                 "IntegrityError": IntegrityError}
        raise kinds.get(result["error"]["kind"], RegistryError)(result["error"]["message"])
    return result


def verify_vllm(registry: Registry, model_dir: Path, ref: Reference | str, *,
                suffix_ids: Sequence[int], steps: int = 8, allow_cross_engine: bool = False,
                dtype: str | None = None, attest: bool = True,
                require_signed_by: Sequence[str] = ()) -> VllmFidelityReport:
    """Run the check (one engine start) and attest it: a same-engine pass as passed and
    byte-exact; a cross-engine measurement as not passed and not byte-exact (it measures
    agreement, it does not verify), so `--require-verified` is never satisfied by it."""
    if not suffix_ids:
        raise UsageError("the suffix has no tokens")
    if steps < 1:
        raise UsageError("the vLLM check compares at least one greedy step")
    registry.require_online("the catalog and store (the check stages the graft and attests)")
    reference = Reference.parse(ref) if isinstance(ref, str) else ref
    opened = registry.open(reference, require_signed_by=require_signed_by,
                           for_verification=True, action="verify-graft")
    manifest = opened.manifest
    kv_dtype, cross = _checkable(registry, model_dir, reference, manifest, dtype,
                                 allow_cross_engine)
    data, _ = opened.fetcher.get(manifest.tokens)
    view = memoryview(data)
    prefix = list(struct.unpack(f"<{view.nbytes // 8}q", view))
    t0 = time.perf_counter()
    result = _check_on_engine(registry, manifest, {
        "model": str(model_dir), "dtype": _VLLM_DTYPES[kv_dtype], "prefix": prefix,
        "suffix": list(suffix_ids), "steps": steps, "cross": cross,
        "expected": manifest.model.to_json(),
        "graft_engine": manifest.model_config.get("engine")})
    report = VllmFidelityReport(
        reference, opened.digest, CROSS if cross else SAME, len(prefix), tuple(suffix_ids),
        int(result["restored"]), int(result["reference_cached"]),
        tuple(Step(**s) for s in result["steps"]), result["engine"],
        ModelIdentity.from_json(result["identity"]), tuple(result["restore_failures"]),
        timings={**result["timings"], "total": round(time.perf_counter() - t0, 3)})
    if attest and (report.byte_exact or (cross and report.ok)):
        report = replace(report, attestation=attest_vllm(registry, report))
    return report


def _checkable(registry: Registry, model_dir: Path, reference: Reference, manifest: Manifest,
               dtype: str | None, allow_cross_engine: bool) -> tuple[str, bool]:
    """(KV dtype, cross-engine?) of a graft this model directory can check in vLLM; a graft
    of another model, or of another engine unless allowed, is refused."""
    kv_dtype = (dtype or manifest.layers[0].dtype).upper()
    if kv_dtype not in _VLLM_DTYPES:
        raise UsageError(f"vLLM cannot run the model in {kv_dtype}")
    fp = fingerprint_dir(model_dir, dtype=kv_dtype, cache_dir=registry.config.cache_dir)
    made_by = graft_engine(manifest)
    cross = made_by != "vllm"
    if cross and not allow_cross_engine:
        raise IncompatibleModel(
            f"graft {reference} was made by {made_by}: its KV is not byte-exact in vLLM",
            hint="--allow-cross-engine measures argmax agreement and KL instead")
    bad = _mismatches(manifest, fp, cross)
    if bad:
        raise IncompatibleModel(f"graft {reference} is not for this model: " + "; ".join(bad))
    return kv_dtype, cross


def _check_on_engine(registry: Registry, manifest: Manifest,
                     spec: Mapping[str, Any]) -> dict[str, Any]:
    """The engine process's result for `spec`, its private registries in a temporary
    directory, the graft staged in one of them."""
    with tempfile.TemporaryDirectory(prefix="kvgraft-vllm-fidelity-") as tmp:
        root = Path(tmp)
        stage, engine = _configs(root, registry.config.cache_dir)
        full = {**spec, "stage": _config_json(stage), "engine_registry": _config_json(engine)}
        # what this vLLM would serve, from its configuration alone: another engine or a
        # graft shorter than a block is refused before an engine starts
        from vllm.engine.arg_utils import EngineArgs

        _logs_to_stderr()
        check_engine(EngineArgs(**engine_kwargs(full)).create_engine_config(), full)
        _stage(registry, manifest, stage)
        try:
            return _run_engine(full, root / "engine.log")
        except subprocess.TimeoutExpired:
            raise RegistryError(f"the vLLM engine ran over {ENGINE_TIMEOUT:.0f} s") from None


def _logs_to_stderr() -> None:
    """vLLM logs to stdout; this command's stdout is its report (`--json` included). vLLM
    reads the variable when it configures its logging (on first use); handlers it made
    already are moved."""
    import logging

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    for h in logging.getLogger("vllm").handlers:
        if (type(h) is logging.StreamHandler  # a FileHandler (a subclass) keeps its file
                and h.stream is not sys.stderr):
            h.setStream(sys.stderr)


def attest_vllm(registry: Registry, report: VllmFidelityReport) -> int:
    import torch
    import vllm

    claim = ("restored graft gives vLLM's own two-step greedy tokens and bit-equal "
             "log-probs" if report.mode == SAME else
             "approximate: argmax agreement and KL against vLLM computing the prompt itself; "
             "not byte-exact")
    statement = fidelity_statement(report.digest, report.model, report.byte_exact, details={
        "host": registry.host, "creator": f"{registry.user}@{registry.host}",
        "engine": dict(report.engine), "claim": claim,
        "versions": {"kvgraft": __version__, "vllm": str(vllm.__version__),
                     "torch": str(torch.__version__), "python": platform.python_version()},
        "result": {**report.summary(), "prefix_tokens": report.prefix_tokens,
                   "suffix_tokens": list(report.suffix_tokens),
                   "continuation": [s.graft_token for s in report.steps]}})
    ref = report.reference
    return registry.attest(statement, detail={"repository": ref.name, "engine": "vllm",
                                              "mode": report.mode})


# --- the engine side (its own process) ---------------------------------------------------

def _vector(step: Mapping[int, Any], vocab: int) -> Any:
    import numpy as np

    out = np.full(vocab, -np.inf)
    for token, lp in step.items():
        out[token] = lp.logprob
    return out


def _compare(i: int, graft: Any, ref: Any, g_tok: int, r_tok: int) -> dict[str, Any]:
    import numpy as np

    finite = np.isfinite(ref) & np.isfinite(graft)
    diff = float(np.max(np.abs(graft[finite] - ref[finite]))) if finite.any() else 0.0
    live = np.isfinite(ref)  # tokens the reference gives a probability
    with np.errstate(over="ignore", invalid="ignore"):
        kl = float(np.sum(np.exp(ref[live]) * (ref[live] - graft[live])))
    return {"index": i, "graft_token": g_tok, "reference_token": r_tok,
            "graft_logprob": float(graft[g_tok]), "reference_logprob": float(ref[r_tok]),
            "identical": bool(np.array_equal(graft, ref)), "max_abs_diff": diff,
            "kl": max(kl, 0.0) if not math.isnan(kl) else math.inf}


def _events(config: Mapping[str, str], wait: float) -> list[Any]:
    """The engine registry's restore events (written off the request path: waited for)."""
    reg = _registry(config)
    try:
        deadline = time.monotonic() + wait
        while True:
            events = list(reg.log(action="restore"))
            if events or time.monotonic() > deadline:
                return events
            time.sleep(0.2)
    finally:
        reg.close()


def engine_kwargs(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's arguments (the same for `LLM` and for `EngineArgs`)."""
    from vllm.config import KVTransferConfig

    eng = spec["engine_registry"]
    ktc = KVTransferConfig(
        kv_connector="KvgraftConnector", kv_connector_module_path="kvgraft.integrations.vllm",
        kv_role="kv_consumer", kv_connector_extra_config={
            **eng, "repository": STAGED.name, "publish": False, "restore": True,
            "allow_cross_engine": bool(spec["cross"])})
    tokens = len(spec["prefix"]) + len(spec["suffix"]) + int(spec["steps"])
    return {"model": spec["model"], "skip_tokenizer_init": True, "dtype": spec["dtype"],
            "max_model_len": -(-tokens // 128) * 128, "enforce_eager": True,
            "kv_transfer_config": ktc, "max_num_seqs": 1, "seed": 0, "max_logprobs": -1,
            "enable_prefix_caching": True}


def check_engine(vllm_config: Any, spec: Mapping[str, Any]) -> EngineIdentity:
    """Refuse a graft this engine cannot restore: another model or engine (exit 5), or
    one shorter than a block (exit 2)."""
    ident = engine_identity(vllm_config, backend=ATTENTION_BACKEND,
                            cache_dir=Path(spec["engine_registry"]["cache_dir"]))
    live = ident.plain if spec["cross"] else ident.identity
    if live.to_json() != spec["expected"]:
        theirs = spec.get("graft_engine") or {}
        diff = [f"{k} {theirs.get(k)} (graft) vs {v} (here)" for k, v in ident.engine.items()
                if not spec["cross"] and theirs.get(k) != v]
        raise IncompatibleModel("the graft was made by another engine or model than this "
                                "vLLM serves" + (": " + ", ".join(diff) if diff else ""))
    block = ident.block_size
    prefix = len(spec["prefix"])
    if min(prefix, prefix + len(spec["suffix"]) - 1) // block == 0:
        raise UsageError(f"a graft of {prefix} tokens holds no whole vLLM block of "
                         f"{block} tokens: nothing to restore")
    return ident


def _registry(config: Mapping[str, str]) -> Registry:
    return Registry(Config(Path(config["home"]), config["catalog_url"], config["blob_url"],
                           Path(config["cache_dir"])))


def _copy_staged(spec: Mapping[str, Any]) -> None:
    """Copy the staged graft into the registry the engine's connector reads."""
    stage, target = _registry(spec["stage"]), _registry(spec["engine_registry"])
    try:
        stage.copy(STAGED, target, STAGED)
    finally:
        stage.close()
        target.close()


def run_engine(spec: Mapping[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prefix, suffix, steps = list(spec["prefix"]), list(spec["suffix"]), int(spec["steps"])
    prompt = prefix + suffix
    eng = spec["engine_registry"]
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(spec))
    t1 = time.perf_counter()
    ident = check_engine(llm.llm_engine.vllm_config, spec)
    params = SamplingParams(max_tokens=steps, temperature=0.0, detokenize=False, logprobs=-1)

    def generate(ids: list[int], p: Any = params) -> Any:
        return llm.generate([TokensPrompt(prompt_token_ids=ids)], p, use_tqdm=False)[0]

    generate(prefix, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))
    ref = generate(prompt)
    t2 = time.perf_counter()
    if not llm.reset_prefix_cache():
        raise RegistryError("vLLM did not empty its prefix cache")
    _copy_staged(spec)
    graft = generate(prompt)
    t3 = time.perf_counter()
    restored = int(graft.num_cached_tokens or 0)
    events = _events(eng, 30.0)
    g, r = graft.outputs[0], ref.outputs[0]
    vocab = 1 + max(max(s) for s in [*(g.logprobs or []), *(r.logprobs or [])])
    compared = [_compare(i, _vector(gs, vocab), _vector(rs, vocab), gt, rt)
                for i, (gs, rs, gt, rt) in enumerate(zip(g.logprobs or [], r.logprobs or [],
                                                          g.token_ids, r.token_ids,
                                                          strict=False))]
    return {"restored": restored, "reference_cached": int(ref.num_cached_tokens or 0),
            "steps": compared, "engine": ident.engine, "identity": ident.identity.to_json(),
            "restore_failures": [str(e.detail.get("reason")) for e in events
                                 if e.outcome != "ok"],
            "timings": {"engine_start": round(t1 - t0, 3), "reference": round(t2 - t1, 3),
                        "graft": round(t3 - t2, 3)}}


def main(argv: Sequence[str]) -> int:
    try:
        result = run_engine(json.loads(argv[0]))
    except RegistryError as e:
        result = {"error": {"kind": type(e).__name__, "message": e.message}}
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

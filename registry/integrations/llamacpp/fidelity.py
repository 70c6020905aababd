"""The fidelity check on llama.cpp: a graft restored into the model must give logits
byte-identical to llama.cpp computing the same prefix and then the suffix (the two-step),
in this process, with these settings; the greedy continuation must be the same. With
`recompute`, the prefix's KV from that fresh prefill is converted as capture converts it
and every tensor digest compared with the manifest. A pass is stored as the fidelity
attestation (the predicate the transformers and vLLM checks store)."""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvgraft import __version__
from kvgraft.client import Registry
from kvgraft.errors import UsageError
from kvgraft.integrations.fidelity import (
    FidelityReport,
    Position,
    compare_kv,
    compare_rows,
    kv_digests,
)
from kvgraft.integrations.llamacpp.engine import LlamaModel, fit_context
from kvgraft.integrations.llamacpp.graft import (
    LlamaGraft,
    greedy,
    load_graft,
    prefill,
    state_tensors,
)
from kvgraft.integrations.llamacpp.state import kv_tensors
from kvgraft.provenance.statement import fidelity_statement
from kvgraft.reference import Reference

DEFAULT_SUFFIX = " In summary,"
CLAIM = ("restored graft gives llama.cpp's own two-step logits (prefix, then suffix) byte "
         "for byte, and the same greedy tokens")


def _positions(g: list[tuple[Any, int]], f: list[tuple[Any, int]]) -> tuple[Position, ...]:
    out: list[Position] = []
    for i, ((a, _), (b, _)) in enumerate(zip(g, f, strict=False)):
        out += compare_rows("suffix" if i == 0 else "greedy", i, a, b)
    return tuple(out)


def recompute_tensors(lm: LlamaModel, graft: LlamaGraft) -> dict[str, Any]:
    """Compare the KV llama.cpp holds now (a fresh prefill of the graft's tokens),
    converted as capture converts it, with the graft's."""
    fresh = kv_tensors(state_tensors(lm, graft.token_count))
    return compare_kv(kv_digests((k.data, v.data) for k, v, _ in kv_tensors(graft.layers)),
                      kv_digests((k.data, v.data) for k, v, _ in fresh))


def verify_graft(registry: Registry, lm: LlamaModel, ref: Reference | str, *,
                 suffix: str | None = None, steps: int = 8, recompute: bool = False,
                 attest: bool = True, require_signed_by: Sequence[str] = (),
                 ) -> FidelityReport:
    """Restore `ref`, feed the suffix and `steps` greedy tokens; then the same from a fresh
    prefill; compare logits byte for byte. A pass is attested (online)."""
    ids = lm.tokenize(DEFAULT_SUFFIX if suffix is None else suffix, special=False)
    if not ids:
        raise UsageError("the suffix has no tokens")
    if steps < 0:
        raise UsageError("steps must be at least 0")
    reference = Reference.parse(ref) if isinstance(ref, str) else ref
    t0 = time.perf_counter()
    graft = load_graft(registry, lm, reference, require_signed_by=require_signed_by,
                       for_verification=True)
    lm = fit_context(lm, graft.token_count + len(ids) + steps + 1)
    graft.restore(lm)
    t1 = time.perf_counter()
    grafted = greedy(lm, ids, steps)
    t2 = time.perf_counter()
    prefill(lm, graft.token_ids)
    checked = (recompute_tensors(lm, graft)
               if recompute else None)
    t3 = time.perf_counter()
    fresh = greedy(lm, ids, steps)
    t4 = time.perf_counter()
    report = FidelityReport(
        reference, graft.digest, graft.token_count, tuple(ids), _positions(grafted, fresh),
        tuple(t for _, t in grafted), tuple(t for _, t in fresh), dict(lm.engine), checked,
        None, {"load_restore": round(t1 - t0, 6), "grafted": round(t2 - t1, 6),
               "fresh_prefill": round(t3 - t2, 6), "fresh": round(t4 - t3, 6)})
    if report.ok and attest and not registry.config.offline:
        report = replace(report, attestation=attest_fidelity(registry, report, lm))
    return report


def attest_fidelity(registry: Registry, report: FidelityReport, lm: LlamaModel) -> int:
    import llama_cpp

    statement = fidelity_statement(report.digest, lm.identity, report.ok, details={
        "host": registry.host, "creator": f"{registry.user}@{registry.host}",
        "engine": dict(report.engine), "claim": CLAIM,
        "versions": {"kvgraft": __version__, "llama_cpp_python": str(llama_cpp.__version__),
                     "python": platform.python_version()},
        "result": {**report.summary(), "prefix_tokens": report.prefix_tokens,
                   "suffix_tokens": list(report.suffix_tokens),
                   "logits_sha256": [p.graft_sha256 for p in report.positions],
                   "continuation": list(report.graft_tokens), "recompute": report.recompute}})
    ref = report.reference
    return registry.attest(statement, detail={"repository": ref.name, "engine": "llama.cpp"})

"""The fidelity check: a graft restored into this model must give logits byte-identical to
computing the same prefix fresh and then the suffix (the "fresh two-step"), in this run,
with this thread count. (It is not always byte-identical to one forward over prefix and
suffix together: kernels block a longer sequence differently.)

A check that passes is stored as an in-toto Statement v1 attestation on the artifact digest.
"""

from __future__ import annotations

import dataclasses
import platform
import socket
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import torch

from kvgraft import __version__
from kvgraft.client import Registry
from kvgraft.digest import Digest, canonical_json
from kvgraft.errors import UsageError
from kvgraft.integrations.fidelity import FidelityReport, Position, compare_kv, kv_digests
from kvgraft.integrations.transformers.capture import (
    cache_tensors,
    prefill,
    raw_bytes,
    tokenize,
)
from kvgraft.integrations.transformers.generate import Step, greedy
from kvgraft.integrations.transformers.loader import Graft, load_graft
from kvgraft.integrations.transformers.models import LoadedModel, engine_info
from kvgraft.reference import Reference

FIDELITY_PREDICATE = "https://kvgraft.dev/attestations/fidelity/v1"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
DEFAULT_SUFFIX = " In summary,"


def _compare(phase: str, start: int, g: Any, f: Any) -> list[Position]:
    out = []
    for j in range(g.shape[0]):
        a, b = g[j], f[j]
        pa = torch.log_softmax(a.double(), -1)
        pb = torch.log_softmax(b.double(), -1)
        kl = float(torch.sum(pb.exp() * (pb - pa)).item())
        out.append(Position(phase, start + j, Digest.of(raw_bytes(a)).hex,
                            Digest.of(raw_bytes(b)).hex, int(torch.argmax(a).item()),
                            int(torch.argmax(b).item()), max(kl, 0.0),
                            float((a.double() - b.double()).abs().max().item())))
    return out


def _positions(g: list[Step], f: list[Step]) -> list[Position]:
    out = _compare("suffix", 0, g[0].logits, f[0].logits)
    for i, (a, b) in enumerate(zip(g[1:], f[1:], strict=False)):
        out += _compare("greedy", i + 1, a.logits, b.logits)
    return out


def recompute_tensors(lm: LoadedModel, graft: Graft) -> dict[str, Any]:
    """Prefill the graft's tokens again and compare every KV tensor's digest with the
    graft's."""
    cache, _ = prefill(lm, graft.token_ids, record_past=True)
    fresh = cache_tensors(cache, graft.token_count)
    return compare_kv(kv_digests((raw_bytes(lr.key), raw_bytes(lr.value)) for lr in graft.layers),
                      kv_digests((raw_bytes(k), raw_bytes(v)) for k, v, _ in fresh))


def verify_graft(registry: Registry, lm: LoadedModel, ref: Reference | str, *,
                 suffix: str | None = None, suffix_ids: Sequence[int] | None = None,
                 steps: int = 8, recompute: bool = False, attest: bool = True,
                 require_signed_by: Sequence[str] = ()) -> FidelityReport:
    """Compare the grafted continuation with the fresh two-step one (and, with
    `recompute`, the stored tensors with a fresh prefill); attest a passing check. The
    graft is opened under the policy's signature requirement (`require_signed_by` adds
    to it); require_verified does not apply to the check that produces verification."""
    import time

    if suffix is not None and suffix_ids is not None:
        raise UsageError("give a suffix text or suffix ids, not both")
    ids = (list(suffix_ids) if suffix_ids is not None
           else tokenize(lm.tokenizer, suffix if suffix is not None else DEFAULT_SUFFIX,
                         special=False))
    if not ids:
        raise UsageError("the suffix has no tokens")
    if steps < 0:
        raise UsageError("steps must be at least 0")
    reference = Reference.parse(ref) if isinstance(ref, str) else ref
    t0 = time.perf_counter()
    graft = load_graft(reference, lm, registry=registry, require_signed_by=require_signed_by,
                       for_verification=True)
    t1 = time.perf_counter()
    grafted = greedy(lm, graft.cache(), ids, steps)
    t2 = time.perf_counter()
    fresh_cache, _ = prefill(lm, graft.token_ids)
    fresh = greedy(lm, fresh_cache, ids, steps)
    t3 = time.perf_counter()
    timings = {"load": t1 - t0, "grafted": t2 - t1, "fresh": t3 - t2}
    checked = (recompute_tensors(lm, graft)
               if recompute else None)
    report = FidelityReport(
        reference, graft.digest, graft.token_count, tuple(ids), tuple(_positions(grafted, fresh)),
        tuple(s.token for s in grafted), tuple(s.token for s in fresh),
        engine_info(lm.model), checked, None, {k: round(v, 6) for k, v in timings.items()})
    if report.ok and attest and not registry.config.offline:
        att = attest_fidelity(registry, report, lm)
        report = dataclasses.replace(report, attestation=att)
    return report


def statement(report: FidelityReport, lm: LoadedModel, creator: str) -> dict[str, Any]:
    """An in-toto Statement v1 about the artifact digest."""
    import transformers

    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": str(report.reference), "digest": {"sha256": report.digest.hex}}],
        "predicateType": FIDELITY_PREDICATE,
        "predicate": {
            "model": lm.fingerprint.identity.to_json(), "passed": report.ok,
            "checkedAt": datetime.now(UTC).isoformat(),
            "host": socket.gethostname(), "creator": creator,
            "engine": report.engine,
            "versions": {"kvgraft": __version__, "transformers": transformers.__version__,
                         "torch": torch.__version__, "python": platform.python_version()},
            "identity": lm.fingerprint.identity.to_json(),
            "claim": "grafted logits are byte-identical to the fresh two-step computation",
            "result": {**report.summary(), "prefix_tokens": report.prefix_tokens,
                       "suffix_tokens": list(report.suffix_tokens),
                       "logits_sha256": [p.graft_sha256 for p in report.positions],
                       "continuation": list(report.graft_tokens),
                       "recompute": report.recompute},
        },
    }


def attest_fidelity(registry: Registry, report: FidelityReport, lm: LoadedModel) -> int:
    creator = f"{registry.user}@{registry.host}"
    body = canonical_json(statement(report, lm, creator))
    return registry.trail.attest_bytes(report.digest, FIDELITY_PREDICATE, body,
                                       reference=report.reference)

"""What a fidelity check reports, whichever engine ran it: each compared row of logits
(graft against the fresh two-step) and the verdict. Pure values: the engines compute the
rows (kvgraft.integrations.transformers.fidelity, kvgraft.integrations.llamacpp.fidelity)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvgraft.digest import Buffer, Digest
from kvgraft.reference import Reference


@dataclass(frozen=True, slots=True)
class Position:
    """One compared logits row: after suffix token `index` (or greedy step)."""

    phase: str  # "suffix" or "greedy"
    index: int
    graft_sha256: str
    fresh_sha256: str
    graft_argmax: int
    fresh_argmax: int
    kl: float  # KL(fresh || graft), nats
    max_abs_diff: float

    @property
    def identical(self) -> bool:
        return self.graft_sha256 == self.fresh_sha256

    def to_json(self) -> dict[str, Any]:
        return {"phase": self.phase, "index": self.index, "identical": self.identical,
                "graft_sha256": self.graft_sha256, "fresh_sha256": self.fresh_sha256,
                "graft_argmax": self.graft_argmax, "fresh_argmax": self.fresh_argmax,
                "kl": self.kl, "max_abs_diff": self.max_abs_diff}


@dataclass(frozen=True, slots=True)
class FidelityReport:
    reference: Reference
    digest: Digest
    prefix_tokens: int
    suffix_tokens: tuple[int, ...]
    positions: tuple[Position, ...]
    graft_tokens: tuple[int, ...]  # greedy continuation after the suffix
    fresh_tokens: tuple[int, ...]
    engine: dict[str, Any]
    recompute: dict[str, Any] | None = None  # KV tensor digests recomputed vs the graft's
    attestation: int | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def byte_identical(self) -> bool:
        return (all(p.identical for p in self.positions)
                and self.graft_tokens == self.fresh_tokens)

    @property
    def ok(self) -> bool:
        return self.byte_identical and (self.recompute is None or self.recompute["ok"])

    @property
    def argmax_agreement(self) -> float:
        return sum(p.graft_argmax == p.fresh_argmax for p in self.positions) / len(self.positions)

    @property
    def max_kl(self) -> float:
        return max(p.kl for p in self.positions)

    @property
    def max_abs_diff(self) -> float:
        return max(p.max_abs_diff for p in self.positions)

    def summary(self) -> dict[str, Any]:
        return {"byte_identical": self.byte_identical, "ok": self.ok,
                "positions": len(self.positions),
                "identical_positions": sum(p.identical for p in self.positions),
                "argmax_agreement": self.argmax_agreement, "max_kl": self.max_kl,
                "max_abs_diff": self.max_abs_diff,
                "greedy_steps": len(self.graft_tokens),
                "greedy_identical": self.graft_tokens == self.fresh_tokens}

    def to_json(self) -> dict[str, Any]:
        return {"reference": str(self.reference), "digest": str(self.digest),
                "prefix_tokens": self.prefix_tokens, "suffix_tokens": list(self.suffix_tokens),
                **self.summary(), "graft_continuation": list(self.graft_tokens),
                "fresh_continuation": list(self.fresh_tokens), "engine": self.engine,
                "recompute": self.recompute, "attestation": self.attestation,
                "timings": self.timings, "detail": [p.to_json() for p in self.positions]}


def compare_rows(phase: str, start: int, graft: np.ndarray, fresh: np.ndarray,
                 ) -> list[Position]:
    """Positions for float logits rows (one row per position, or one row)."""
    out = []
    for j, (a, b) in enumerate(zip(np.atleast_2d(graft), np.atleast_2d(fresh), strict=True)):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        la, lb = a64 - np.logaddexp.reduce(a64), b64 - np.logaddexp.reduce(b64)
        kl = float(np.sum(np.exp(lb) * (lb - la)))
        out.append(Position(phase, start + j, Digest.of(a.tobytes()).hex,
                            Digest.of(b.tobytes()).hex, int(np.argmax(a)), int(np.argmax(b)),
                            max(kl, 0.0), float(np.abs(a64 - b64).max())))
    return out


def kv_digests(layers: Iterable[tuple[Buffer, Buffer]]) -> dict[str, Digest]:
    """The digest of each layer's key and value bytes, under their KV file names."""
    return {f"layers.{i}.{kind}": Digest.of(data)
            for i, pair in enumerate(layers) for kind, data in zip(("key", "value"), pair,
                                                                   strict=True)}


def compare_kv(graft: Mapping[str, Digest], recomputed: Mapping[str, Digest]) -> dict[str, Any]:
    """The `recompute` part of a fidelity report: every recomputed KV tensor against the
    graft's (whose bytes were verified against its manifest when it was loaded)."""
    bad = [{"tensor": name, "expected": str(graft.get(name)), "found": str(got)}
           for name, got in recomputed.items() if graft.get(name) != got]
    return {"ok": not bad and len(recomputed) == len(graft), "checked": len(recomputed),
            "mismatches": bad}

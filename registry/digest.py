"""Digest values ("sha256:<hex>"), hashing helpers and the canonical JSON that is hashed."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from kvgraft.errors import IntegrityError, UsageError

_HEX64 = re.compile(r"[0-9a-f]{64}")

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, order=True, slots=True)
class Digest:
    """A SHA-256 digest tagged with its algorithm. Valid by construction."""

    hex: str

    def __post_init__(self) -> None:
        if not _HEX64.fullmatch(self.hex):
            raise UsageError(f"not a sha256 hex digest: {self.hex!r}")

    @classmethod
    def parse(cls, text: str) -> Digest:
        algo, sep, hexpart = text.partition(":")
        if not sep or algo != "sha256":
            raise UsageError(f"not a digest (expected sha256:<64 hex>): {text!r}")
        return cls(hexpart)

    @classmethod
    def of(cls, *parts: Buffer) -> Digest:
        h = hashlib.sha256()
        for p in parts:
            h.update(p)
        return cls(h.hexdigest())

    @classmethod
    def from_hasher(cls, h: Any) -> Digest:
        return cls(h.hexdigest())

    @property
    def raw(self) -> bytes:
        return bytes.fromhex(self.hex)

    @property
    def short(self) -> str:
        return self.hex[:12]

    def __str__(self) -> str:
        return f"sha256:{self.hex}"

    def check(self, actual: Digest, what: str) -> None:
        """Raise IntegrityError unless `actual` equals this digest."""
        if actual != self:
            raise IntegrityError(f"{what}: digest mismatch, expected {self}, got {actual}")


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the one byte form that kvgraft hashes."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")

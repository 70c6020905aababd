"""Lineage and attestation queries: an artifact's parents as its stored manifest names
them, the artifacts that name it as a parent, and the attestations made about it."""

from __future__ import annotations

import json

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvgraft.catalog.models import ArtifactRow, AttestationRow
from kvgraft.catalog.records import stored_digest
from kvgraft.digest import Digest


def stored_parents(digest: str, raw: str) -> tuple[Digest, ...] | None:
    """The parents the stored manifest of artifact `digest` names, or None when the row
    cannot say: its text is not the manifest the digest names (edited, truncated) or not
    one at all. Push validated the manifest before storing it, so text that still hashes
    to its digest is trusted as it stands."""
    if str(Digest.of(raw.encode())) != digest:
        return None
    if raw.count('"parents":') == 1 and '"parents":[]' in raw:
        # Canonical JSON writes `"parents":` unescaped only as a key, so once means the
        # manifest's own, here empty: most artifacts, without parsing all their JSON
        # (most of gc's planning time at a million chunk rows).
        return ()
    try:
        parents = json.loads(raw)["parents"]
        return tuple(Digest.parse(p) for p in parents)
    except (ValueError, LookupError, TypeError):
        return None


def _parents(digest: str, raw: str) -> tuple[Digest, ...]:
    # Lineage display: a corrupt manifest names no parents here; audit reports it when
    # it reads that artifact.
    return stored_parents(digest, raw) or ()


def children(s: Session, digest: Digest) -> list[Digest]:
    # No parents table: manifests name their parents, and an artifact digest appears in
    # another manifest only there, so a LIKE narrows and the parse decides.
    rows = s.execute(select(ArtifactRow.digest, ArtifactRow.manifest)
                     .where(ArtifactRow.manifest.like(f'%"{digest}"%')))
    return sorted(stored_digest(d, "artifacts") for d, raw in rows if digest in _parents(d, raw))


def attestation_digests(s: Session, digest: Digest) -> dict[int, str]:
    rows = s.execute(select(AttestationRow.id, AttestationRow.statement_digest)
                     .where(AttestationRow.artifact_digest == str(digest)))
    return {i: d for i, d in rows}

"""A graft as one OCI image manifest (docs/server.md has the mapping).

The layers are the kvgraft manifest (its digest is the artifact digest) and every blob the
graft needs (KV file header, token ids, chunks), each described by the digest and size of
its decoded bytes: exactly what `GET /v2/<name>/blobs/<digest>` sends. The config is the
OCI empty descriptor. The rendering is canonical JSON, so a graft always renders to the
same bytes and therefore the same OCI manifest digest.
"""

from __future__ import annotations

from typing import Any

from kvgraft.digest import Digest, canonical_json
from kvgraft.formats.manifest import MEDIA_TYPE as KVGRAFT_MANIFEST
from kvgraft.formats.manifest import Manifest

EMPTY_JSON = b"{}"  # the OCI empty descriptor's content: the config of every graft's manifest
EMPTY_DIGEST = str(Digest.of(EMPTY_JSON))

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
ARTIFACT_TYPE = "application/vnd.kvgraft.graft.v1"
HEADER_TYPE = "application/vnd.kvgraft.kv-header.v1"
TOKENS_TYPE = "application/vnd.kvgraft.token-ids.v1"
CHUNK_TYPE = "application/vnd.kvgraft.chunk.v1+safetensors"


def render(manifest: Manifest, created: str) -> bytes:
    raw = manifest.canonical()
    layers: list[dict[str, Any]] = [
        {"mediaType": KVGRAFT_MANIFEST, "digest": str(manifest.digest), "size": len(raw)},
        {"mediaType": HEADER_TYPE, "digest": str(manifest.header.digest),
         "size": manifest.header.size},
        {"mediaType": TOKENS_TYPE, "digest": str(manifest.tokens.digest),
         "size": manifest.tokens.size},
    ]
    seen = {manifest.header.digest, manifest.tokens.digest}
    for c in manifest.chunks:
        layers.append({"mediaType": CHUNK_TYPE, "digest": str(c.digest), "size": c.size,
                       "annotations": {"org.kvgraft.chunk.index": str(c.index),
                                       "org.kvgraft.chunk.start": str(c.start),
                                       "org.kvgraft.chunk.end": str(c.end),
                                       "org.kvgraft.chunk.prefix": str(c.prefix),
                                       **({"org.kvgraft.chunk.repeat": "true"}
                                          if c.digest in seen else {})}})
        seen.add(c.digest)
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": OCI_EMPTY, "digest": EMPTY_DIGEST, "size": len(EMPTY_JSON)},
        "layers": layers,
        "annotations": {
            "org.opencontainers.image.created": created,
            "org.kvgraft.artifact.digest": str(manifest.digest),
            "org.kvgraft.model.identity": str(manifest.model.key),
            "org.kvgraft.model.name": manifest.model_name,
            "org.kvgraft.token-count": str(manifest.token_count),
            "org.kvgraft.file.digest": str(manifest.file_digest),
        },
    }
    return canonical_json(doc)


def oci_digest(rendered: bytes) -> str:
    return str(Digest.of(rendered))


DSSE_TYPE = "application/vnd.dsse.envelope.v1+json"
IN_TOTO_TYPE = "application/vnd.in-toto+json"


def render_attestation(statement: bytes, envelope: bytes | None, predicate_type: str,
                       keyid: str | None, attestation_id: int, subject: str,
                       subject_size: int) -> tuple[bytes, bytes]:
    """An attestation of a graft as an OCI manifest whose subject is the graft's OCI
    manifest (so `referrers` lists it): (manifest bytes, its one layer's bytes). A signed
    attestation's layer is its DSSE envelope, an unsigned one's its in-toto statement."""
    blob = envelope if envelope is not None else statement
    kind = DSSE_TYPE if envelope is not None else IN_TOTO_TYPE
    annotations = {"in-toto.io/predicate-type": predicate_type,
                   "org.kvgraft.attestation.id": str(attestation_id)}
    if keyid:
        annotations["org.kvgraft.attestation.keyid"] = keyid
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": kind,
        "config": {"mediaType": OCI_EMPTY, "digest": EMPTY_DIGEST, "size": len(EMPTY_JSON)},
        "layers": [{"mediaType": kind, "digest": str(Digest.of(blob)), "size": len(blob)}],
        "subject": {"mediaType": OCI_MANIFEST, "digest": subject, "size": subject_size},
        "annotations": annotations,
    }
    return canonical_json(doc), blob

"""The artifact manifest: frozen values, canonical JSON, schema validation (docs/format.md §8).

A manifest describes content only. Parsing validates against schemas/manifest.schema.json
and the cross-field rules the schema cannot say, so a Manifest that exists is valid.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from kvgraft import strictjson
from kvgraft.digest import Digest, canonical_json
from kvgraft.errors import IntegrityError
from kvgraft.identity.model import ModelIdentity
from kvgraft.resources import load_schema

MEDIA_TYPE = "application/vnd.kvgraft.manifest.v1+json"
# Version 2 names the file by a tree over the blob digests (`file_tree`) and keeps no
# per-tensor digests, so push hashes each byte once; version 1 stays readable.
VERSIONS = (1, 2)
CURRENT = 2
_TREE_DOMAIN = b"kvgraft.file.v2\n"


def file_tree(size: int, chunk_tokens: int, header: Digest, tokens: Digest,
              chunks: Sequence[Digest]) -> Digest:
    """The file digest of a version 2 manifest (docs/format.md §9.3): SHA-256 over the
    digests of the blobs the file is rebuilt from, which fix every byte of it."""
    return Digest.of(_TREE_DOMAIN, struct.pack("<QQ", size, chunk_tokens), header.raw,
                     tokens.raw, b"".join(c.raw for c in chunks))


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    # jsonschema.validate() re-checks the schema itself on every call (tens of ms).
    schema = load_schema("manifest")
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator: jsonschema.protocols.Validator = cls(schema)
    return validator


@dataclass(frozen=True, slots=True)
class BlobRef:
    digest: Digest
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"digest": str(self.digest), "size": self.size}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> BlobRef:
        return cls(Digest.parse(d["digest"]), d["size"])


@dataclass(frozen=True, slots=True)
class ChunkRef:
    index: int
    start: int
    end: int
    digest: Digest
    size: int
    prefix: Digest

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "start": self.start, "end": self.end,
                "digest": str(self.digest), "size": self.size, "prefix": str(self.prefix)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ChunkRef:
        return cls(d["index"], d["start"], d["end"], Digest.parse(d["digest"]), d["size"],
                   Digest.parse(d["prefix"]))


@dataclass(frozen=True, slots=True)
class LayerRef:
    index: int
    start: int
    length: int
    dtype: str
    kv_heads: int
    key_dim: int
    value_dim: int

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "start": self.start, "length": self.length,
                "dtype": self.dtype, "kvHeads": self.kv_heads, "keyDim": self.key_dim,
                "valueDim": self.value_dim}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LayerRef:
        return cls(d["index"], d["start"], d["length"], d["dtype"], d["kvHeads"],
                   d["keyDim"], d["valueDim"])


@dataclass(frozen=True, slots=True)
class Manifest:
    model: ModelIdentity
    model_name: str
    model_config: Mapping[str, Any]
    token_count: int
    tokens: BlobRef
    chunk_tokens: int
    chunks: tuple[ChunkRef, ...]
    layers: tuple[LayerRef, ...]
    tensors: Mapping[str, Digest]  # version 1 only; empty in version 2
    file_digest: Digest  # version 1: SHA-256 of the file; version 2: `file_tree`
    file_size: int
    header: BlobRef
    parents: tuple[Digest, ...] = ()
    provenance: Mapping[str, Any] = field(default_factory=dict)
    version: int = CURRENT

    def to_json(self) -> dict[str, Any]:
        doc = {
            "schemaVersion": self.version,
            "mediaType": MEDIA_TYPE,
            "model": {**self.model.to_json(), "name": self.model_name,
                      "config": dict(self.model_config)},
            "tokens": {"count": self.token_count, "blob": self.tokens.to_json()},
            "chunkTokens": self.chunk_tokens,
            "chunks": [c.to_json() for c in self.chunks],
            "layers": [lr.to_json() for lr in self.layers],
            "tensors": {k: str(v) for k, v in sorted(self.tensors.items())},
            "file": {"digest": str(self.file_digest), "size": self.file_size,
                     "header": self.header.to_json()},
            "parents": [str(p) for p in self.parents],
            "provenance": dict(self.provenance),
        }
        if self.version >= 2:
            del doc["tensors"]
        return doc

    def canonical(self) -> bytes:
        return canonical_json(self.to_json())

    @property
    def digest(self) -> Digest:
        return Digest.of(self.canonical())

    @property
    def size(self) -> int:
        """Decoded bytes of every blob the artifact needs (header, tokens, chunks)."""
        return self.header.size + self.tokens.size + sum(c.size for c in self.chunks)

    def blobs(self) -> list[BlobRef]:
        """Every blob the artifact needs, each once, in rebuild order."""
        seen: dict[Digest, BlobRef] = {}
        for ref in [self.header, self.tokens, *(BlobRef(c.digest, c.size) for c in self.chunks)]:
            seen.setdefault(ref.digest, ref)
        return list(seen.values())

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        try:
            _validator().validate(data)
        except jsonschema.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "<root>"
            raise IntegrityError(f"manifest fails its schema at {where}: {e.message}") from None
        m = data["model"]
        manifest = cls(
            model=ModelIdentity.from_json(m),
            model_name=m["name"],
            model_config=m["config"],
            token_count=data["tokens"]["count"],
            tokens=BlobRef.from_json(data["tokens"]["blob"]),
            chunk_tokens=data["chunkTokens"],
            chunks=tuple(ChunkRef.from_json(c) for c in data["chunks"]),
            layers=tuple(LayerRef.from_json(x) for x in data["layers"]),
            tensors={k: Digest.parse(v) for k, v in data.get("tensors", {}).items()},
            file_digest=Digest.parse(data["file"]["digest"]),
            file_size=data["file"]["size"],
            header=BlobRef.from_json(data["file"]["header"]),
            parents=tuple(Digest.parse(p) for p in data["parents"]),
            provenance=data["provenance"],
            version=data["schemaVersion"],
        )
        manifest._check()
        return manifest

    @classmethod
    def parse(cls, raw: bytes, expected: Digest | None = None) -> Manifest:
        """Parse stored manifest bytes; with `expected`, the bytes must hash to it."""
        if expected is not None:
            expected.check(Digest.of(raw), "manifest")
        try:
            data = strictjson.loads(raw)
        except ValueError as e:
            raise IntegrityError(f"manifest is not JSON kvgraft accepts: {e}") from None
        manifest = cls.from_json(data)
        if expected is not None and manifest.canonical() != raw:
            raise IntegrityError("manifest is not in canonical form")
        return manifest

    def _check(self) -> None:
        c = self.chunk_tokens
        want = [(i, lo, min(lo + c, self.token_count))
                for i, lo in enumerate(range(0, self.token_count, c))]
        have = [(ch.index, ch.start, ch.end) for ch in self.chunks]
        if have != want:
            raise IntegrityError("manifest chunks do not tile the token axis")
        if self.tokens.size != 8 * self.token_count:
            raise IntegrityError("manifest token blob size does not match the token count")
        if [lr.index for lr in self.layers] != list(range(len(self.layers))):
            raise IntegrityError("manifest layers are not numbered 0..L-1")
        if self.file_size < self.header.size + self.tokens.size:
            raise IntegrityError("manifest file size is smaller than its header and tokens")
        if self.version not in VERSIONS:
            raise IntegrityError(f"manifest version {self.version} is not one of {VERSIONS}")
        if self.version >= 2:
            if self.tensors:
                raise IntegrityError("a version 2 manifest has no tensor digests")
            tree = file_tree(self.file_size, self.chunk_tokens, self.header.digest,
                             self.tokens.digest, [ch.digest for ch in self.chunks])
            if self.file_digest != tree:
                raise IntegrityError("manifest file digest is not the tree of its blobs")

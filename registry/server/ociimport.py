"""An OCI manifest of kvgraft's artifactType, pushed through /v2/, becomes a graft
(docs/server.md, "A graft pushed by an OCI client").

Nothing is visible until all of it checks: the kvgraft manifest (the first layer) is held by
the repository, hashes to its digest and is a valid manifest; the pushed bytes are exactly
its OCI rendering (kvgraft.oci.graft.render, with the pushed creation time), so every
descriptor, size and annotation is the one the kvgraft manifest implies; its parents are
grafts the caller may pull; and every blob it names is held by the repository and decodes
from the store to its size and digest, hashed piece by piece. It is then committed as a
kvgraft push is (kvgraft.server.graftcommit), with a `push` event under the token's name.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kvgraft.catalog.records import BlobRecord
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, NotFound, UsageError
from kvgraft.formats.manifest import MEDIA_TYPE as KVGRAFT_MANIFEST
from kvgraft.formats.manifest import Manifest
from kvgraft.oci import graft as ocigraft
from kvgraft.server import content
from kvgraft.server.context import Context
from kvgraft.server.errors import OciError
from kvgraft.server.graftcommit import check_parents, checked_record, commit

CREATED = "org.opencontainers.image.created"


def claims_graft(doc: dict[str, Any]) -> bool:
    """Whether a pushed manifest says it is a graft: its artifactType, or (lacking one)
    its config's media type, is kvgraft's."""
    kind = doc.get("artifactType")
    if kind is None:
        config = doc.get("config")
        kind = config.get("mediaType") if isinstance(config, dict) else None
    return kind == ocigraft.ARTIFACT_TYPE


def put_graft(request: Request, ctx: Context, name: str, raw: bytes, doc: dict[str, Any],
              tags: list[str]) -> Response:
    """Check the pushed graft `raw` (parsed: `doc`) and commit it into `name` under `tags`."""
    manifest = _kvgraft_manifest(ctx, name, doc)
    annotations = doc.get("annotations")
    created = annotations.get(CREATED) if isinstance(annotations, dict) else None
    if not isinstance(created, str) or ocigraft.render(manifest, created) != raw:
        raise OciError(400, "MANIFEST_INVALID",
                       f"the manifest is not the OCI rendering of its kvgraft manifest "
                       f"{manifest.digest}: a graft's OCI manifest is exactly what "
                       "`kvgraft serve` renders for it", detail={"digest": str(manifest.digest)})
    check_parents(request, ctx, manifest)
    records = _verified_blobs(ctx, name, manifest)
    digest = str(Digest.of(raw))
    detail = {"via": "oci", "oci_digest": digest}
    commit(request, ctx, manifest, records, name, tags[0] if tags else None, {}, "push",
           detail)
    for extra in tags[1:]:  # pushed by digest with several ?tag=
        ctx.catalog.set_tag(name, extra, manifest.digest, ctx.event_record(
            request, "tag", repository=name, tag=extra, digest=manifest.digest, detail=detail))
    ctx.graft(manifest.digest)  # its rendering remembered: the OCI digest resolves everywhere
    response = Response(status_code=201, headers={
        "Location": f"/v2/{name}/manifests/{digest}", "Docker-Content-Digest": digest})
    for tag in tags:
        response.headers.append("OCI-Tag", tag)
    return response


def _kvgraft_manifest(ctx: Context, name: str, doc: dict[str, Any]) -> Manifest:
    """The kvgraft manifest the first layer names, read from what `name` holds."""
    layers = doc.get("layers")
    first = layers[0] if isinstance(layers, list) and layers else None
    if not isinstance(first, dict) or first.get("mediaType") != KVGRAFT_MANIFEST:
        raise OciError(400, "MANIFEST_INVALID",
                       f"a manifest of artifactType {ocigraft.ARTIFACT_TYPE} is a graft: an "
                       f"image manifest whose first layer is the kvgraft manifest "
                       f"({KVGRAFT_MANIFEST})")
    size = first.get("size")
    limit = ctx.settings.max_manifest_bytes
    if type(size) is not int or not 0 < size <= limit:
        raise OciError(400, "MANIFEST_INVALID",
                       f"the kvgraft manifest's size must be 1 to {limit} bytes")
    try:
        digest = Digest.parse(str(first.get("digest", "")))
    except UsageError:
        raise OciError(400, "MANIFEST_INVALID", "the kvgraft manifest's digest is not a "
                       "sha256 digest") from None
    held = ctx.oci.blob_size(name, str(digest))
    if held is None and ctx.oci.graft_in(name, str(digest)):
        return ctx.graft_manifest(digest)  # already a graft of this repository
    if held is None:
        raise OciError(400, "MANIFEST_BLOB_UNKNOWN",
                       f"the kvgraft manifest {digest} is not in {name}: upload it first",
                       detail={"digest": str(digest)})
    if held != size:
        raise OciError(400, "MANIFEST_INVALID", f"blob {digest} holds {held} bytes, the "
                       f"manifest says {size}", detail={"digest": str(digest)})
    try:
        body = content.open_blob(ctx.store, str(digest), size)
        return Manifest.parse(b"".join(body.pieces), digest)  # hashed, then parsed
    except NotFound:
        raise OciError(400, "MANIFEST_BLOB_UNKNOWN", f"the kvgraft manifest {digest} is "
                       "missing from the store", detail={"digest": str(digest)}) from None
    except IntegrityError as e:
        raise OciError(400, "MANIFEST_INVALID", f"the kvgraft manifest {digest} is not "
                       f"valid: {e.human()}", detail={"digest": str(digest)}) from None


def _verified_blobs(ctx: Context, name: str, manifest: Manifest) -> tuple[BlobRecord, ...]:
    """The rows of every blob the graft needs: each held by `name` and read back from the
    store to its size and digest, a piece at a time."""
    store = ctx.store
    records = []
    for ref in manifest.blobs():
        blob = str(ref.digest)
        held = ctx.oci.blob_size(name, blob)
        if held is None:
            raise OciError(400, "MANIFEST_BLOB_UNKNOWN",
                           f"blob {blob} named by the manifest is not in {name}",
                           detail={"digest": blob})
        if held != ref.size:
            raise OciError(400, "MANIFEST_INVALID", f"blob {blob} holds {held} bytes, the "
                           f"manifest says {ref.size}", detail={"digest": blob})
        try:
            record = checked_record(store, ref.digest, ref.size)
        except NotFound:
            record = None
        if record is None:
            raise OciError(400, "MANIFEST_BLOB_UNKNOWN",
                           f"blob {blob} named by the manifest is missing or corrupt in the "
                           f"store (it does not read back as {ref.size} bytes hashing to its "
                           "digest)", detail={"digest": blob})
        records.append(record)
    return tuple(records)

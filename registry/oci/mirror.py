"""Mirror a graft into an OCI registry and back (`kvgraft copy` with an oci:// side).

A graft goes out as the very OCI manifest `kvgraft serve` renders for it (docs/server.md):
the empty config, the kvgraft manifest (its digest is the artifact digest), then the KV
header, the token ids and the chunks, each as its decoded bytes. So a registry that holds
the mirror serves what `kvgraft serve` would, and stock clients can pull it.

Coming back, the kvgraft manifest is fetched first and checked against the artifact digest
the OCI manifest names; every other blob is then fetched by the digest and size that
manifest gives, hashed as it arrives, encoded for the store and put there; only then is the
catalog written (one transaction, as a push). Labels do not travel: OCI has no place for
them in the manifest.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvgraft.catalog import PushRecord
from kvgraft.catalog.records import BlobRecord
from kvgraft.client import Registry
from kvgraft.codecs.codec import AUTO, codec_selector, frame, max_stored_size
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, NotFound, UsageError
from kvgraft.formats.manifest import MEDIA_TYPE as KVGRAFT_MANIFEST
from kvgraft.formats.manifest import BlobRef, Manifest
from kvgraft.oci.client import MAX_MANIFEST, OCI_MANIFEST, OciClient, OciLocation
from kvgraft.oci.graft import ARTIFACT_TYPE, render
from kvgraft.reference import Reference
from kvgraft.strictjson import loads as strict_loads
from kvgraft.transfer.pull import verify_stored
from kvgraft.transfer.push import existing_record

WORKERS = 4


@dataclass(frozen=True, slots=True)
class MirrorStats:
    digest: Digest  # the artifact digest
    oci_digest: Digest  # the OCI manifest's digest
    blobs: int  # blobs the graft needs (with the OCI config and the kvgraft manifest)
    copied: int  # blobs transferred
    copied_bytes: int


def push_graft(reg: Registry, src: Reference, client: OciClient, dst: OciLocation,
               ) -> MirrorStats:
    """Mirror the graft `src` of `reg` to `dst`; blobs the registry has are not sent."""
    digest = reg.resolve(src)
    record = reg.catalog.artifact(digest)
    manifest = Manifest.parse(record.manifest, digest)
    rendered = render(manifest, record.created_at.isoformat())
    doc = strict_loads(rendered)
    repo = dst.repository
    store = reg.blob_store(src.name)  # through a kvgraft server: the repository's blobs

    def from_store(ref: BlobRef) -> bytes:
        stored = store.get(ref.digest, max_stored_size(ref.size))
        return bytes(verify_stored(ref, stored, store.url))

    raw = manifest.canonical()
    getters: dict[Digest, Callable[[], bytes]] = {
        Digest.parse(doc["config"]["digest"]): lambda: b"{}",
        digest: lambda: raw,
    }
    sizes = {Digest.parse(doc["config"]["digest"]): doc["config"]["size"], digest: len(raw)}
    for ref in manifest.blobs():
        getters.setdefault(ref.digest, lambda ref=ref: from_store(ref))  # type: ignore[misc]
        sizes.setdefault(ref.digest, ref.size)

    def one(d: Digest) -> int:
        if client.blob_exists(repo, d, sizes[d]):
            return 0
        data = getters[d]()
        client.put_blob(repo, d, data)
        return len(data)

    with ThreadPoolExecutor(WORKERS, thread_name_prefix="kvgraft-oci") as pool:
        moved = [n for n in pool.map(one, list(getters)) if n]
    oci_digest = client.put_manifest(repo, dst.tag, rendered, OCI_MANIFEST)
    reg.events.record("copy", repository=src.name, tag=src.tag, digest=digest, detail={
        "source": f"{reg.config.remote or 'local'}:{src}", "target": str(dst),
        "oci_digest": str(oci_digest), "blobs_copied": len(moved),
        "bytes_copied": sum(moved)})
    return MirrorStats(digest, oci_digest, len(getters), len(moved), sum(moved))


def pull_graft(client: OciClient, src: OciLocation, reg: Registry, dst: Reference,
               ) -> MirrorStats:
    """Copy the graft mirrored at `src` into `reg` as `dst`, every byte verified."""
    if dst.digest is not None:
        raise UsageError(f"the target is name[:tag], not a digest: {dst}")
    body, oci_digest = client.get_manifest(src.repository, src.tag)
    kv_layer = _graft_layer(body, src)
    digest = Digest.parse(kv_layer["digest"])
    raw = client.get_blob(src.repository, digest, kv_layer["size"])
    manifest = Manifest.parse(raw, digest)  # the artifact digest vouches for every blob
    # Before any blob moves: a graft is committed only with its lineage.
    for parent in manifest.parents:
        if not reg.catalog.has_artifact(parent):
            raise NotFound(f"parent artifact {parent} of {src} is not in the catalog",
                           hint="copy the parent first")

    store = reg.blob_store(dst.name)

    def one(ref: BlobRef) -> tuple[BlobRecord, int]:
        existing = existing_record(store, ref.digest, ref.size)
        if existing is not None:
            return existing, 0
        data = client.get_blob(src.repository, ref.digest, ref.size)
        codec = select(data)
        parts = frame(codec, data)
        store.put(ref.digest, parts)
        stored = sum(memoryview(p).nbytes for p in parts)
        return BlobRecord(ref.digest, ref.size, stored, codec.name), stored

    select = codec_selector(AUTO)
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="kvgraft-oci") as pool:
        results = list(pool.map(one, manifest.blobs()))
    moved = [n for _, n in results if n]
    reg.transfers.commit(PushRecord(
        manifest, tuple(r for r, _ in results), dst.name, dst.tag, {},
        reg.events.event("copy", repository=dst.name, tag=dst.tag, digest=digest, detail={
            "source": str(src), "target": f"{reg.config.remote or 'local'}:{dst}",
            "oci_digest": str(oci_digest), "blobs_copied": len(moved),
            "bytes_copied": sum(moved)})),
        lambda: [r for r, _ in map(one, manifest.blobs())])
    return MirrorStats(digest, oci_digest, len(results), len(moved), sum(moved))


def _graft_layer(body: bytes, src: OciLocation) -> dict[str, Any]:
    """The kvgraft-manifest descriptor of an OCI manifest that mirrors a graft."""
    try:
        doc = strict_loads(body)
        layers = doc["layers"]
        first = layers[0]
        ok = (doc.get("mediaType", OCI_MANIFEST) == OCI_MANIFEST
              and doc.get("artifactType") == ARTIFACT_TYPE
              and first["mediaType"] == KVGRAFT_MANIFEST
              and isinstance(first["size"], int) and 0 < first["size"] <= MAX_MANIFEST)
        Digest.parse(first["digest"])
    except (ValueError, KeyError, IndexError, TypeError):
        ok = False
    if not ok:
        raise IntegrityError(f"{src} is not a kvgraft graft",
                             hint=f"a graft's OCI manifest has artifactType {ARTIFACT_TYPE} "
                                  "and the kvgraft manifest as its first layer")
    layer: dict[str, Any] = first
    return layer


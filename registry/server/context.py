"""What every request handler shares: the registry (catalog + store), the server settings,
open uploads, tokens, and the audit trail of who did what."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from starlette.requests import Request

from kvgraft.blobstore import BlobStore
from kvgraft.catalog import Catalog
from kvgraft.catalog.oci import OciTables
from kvgraft.catalog.records import EventRecord
from kvgraft.catalog.tokens import TokenTable
from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import AuthRefused, RegistryError
from kvgraft.formats.manifest import Manifest
from kvgraft.oci import graft as ocigraft
from kvgraft.server import auth
from kvgraft.server.errors import OciError, from_registry_error
from kvgraft.server.metrics import ServerMetrics
from kvgraft.server.settings import ServerSettings
from kvgraft.server.uploads import Uploads

ANCHORS = frozenset({"attest", "sign"})  # the events that record an attestation
_RENDERED = 4096  # grafts whose OCI rendering a worker keeps (they never change)
_SERVE_DIRECT = "serve a catalog and store of your own: a direct remote (--catalog, --store)"


def server_catalog(registry: Registry) -> Catalog:
    """The SQL catalog a server owns (it serves its whole catalog, not a view of one)."""
    return registry.backends.whole_catalog("serving", _SERVE_DIRECT)


def server_store(registry: Registry) -> BlobStore:
    return registry.backends.whole_store("serving", _SERVE_DIRECT)


def attestation_homes(catalog: Catalog, artifact: Digest) -> dict[int, frozenset[str]]:
    """The repositories each attestation of `artifact` was recorded in: those of the
    attest or sign events anchoring its statement digest. Only the server writes these
    events (a client's own events cannot carry an anchor), after checking the writer may
    push there; an attestation counts in its home repositories alone."""
    by_statement: dict[str, set[str]] = {}
    for e in catalog.events(digest=artifact):
        anchor = e.detail.get("statement_digest")
        if e.action in ANCHORS and e.repository is not None and isinstance(anchor, str):
            by_statement.setdefault(anchor, set()).add(e.repository)
    return {i: frozenset(by_statement.get(d, ()))
            for i, d in catalog.attestation_digests(artifact).items()}


@dataclass(frozen=True, slots=True)
class RenderedAttestation:
    id: int
    manifest: bytes
    digest: str  # of the manifest
    artifact_type: str
    annotations: dict[str, str]
    blob: bytes
    blob_digest: str


class Context:
    metrics: ServerMetrics | None = None  # the application's, once it serves

    def __init__(self, registry: Registry, settings: ServerSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.uploads = Uploads(settings.upload_dir, max_open=settings.max_open_uploads,
                               max_per_owner=settings.max_open_uploads_per_token,
                               max_bytes=settings.max_upload_bytes,
                               ttl=settings.upload_ttl_seconds)
        self._rendered: OrderedDict[Digest, tuple[Manifest, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self._remembered: set[str] = set()

    @property
    def catalog(self) -> Catalog:
        return server_catalog(self.registry)

    @property
    def store(self) -> BlobStore:
        return server_store(self.registry)

    @cached_property
    def tokens(self) -> TokenTable:
        return TokenTable(self.catalog)

    @cached_property
    def oci(self) -> OciTables:
        return OciTables(self.catalog)

    # --- who ---------------------------------------------------------------------------

    def authenticate(self, request: Request) -> auth.Principal:
        try:
            return auth.authenticate(request, self.tokens)
        except AuthRefused as e:
            raise OciError(401, "UNAUTHORIZED", e.human(),
                           headers=auth.challenge(request, None)) from None

    def refuse(self, request: Request, principal: auth.Principal | None, repository: str | None,
               action: str) -> OciError:
        return auth.refuse(request, principal, repository, action)

    def registry_error(self, request: Request, e: RegistryError) -> OciError:
        if self.metrics is not None:
            self.metrics.backend_error(e)
        err = from_registry_error(e)
        if err.status == 401:
            err.headers.update(auth.challenge(request, None))
        return err

    def event_record(self, request: Request, action: str, **kw: Any) -> EventRecord:
        principal: auth.Principal | None = getattr(request.state, "principal", None)
        client = request.client.host if request.client else "unknown"
        return EventRecord(action=action, actor=principal.name if principal else auth.ANONYMOUS,
                           host=client, **kw)

    def event(self, request: Request, action: str, **kw: Any) -> None:
        self.catalog.add_event(self.event_record(request, action, **kw))

    # --- grafts ------------------------------------------------------------------------

    def graft(self, digest: Digest) -> tuple[Manifest, bytes]:
        """A graft's manifest and its OCI rendering (remembered in the catalog, so the
        rendering's digest resolves in every worker)."""
        with self._lock:
            hit = self._rendered.get(digest)
            if hit is not None:
                self._rendered.move_to_end(digest)
                return hit
        record = self.catalog.artifact(digest)
        manifest = Manifest.parse(record.manifest, digest)
        rendered = ocigraft.render(manifest, record.created_at.isoformat())
        self.oci.remember(ocigraft.oci_digest(rendered), "manifest", str(digest))
        with self._lock:
            self._rendered[digest] = (manifest, rendered)
            while len(self._rendered) > _RENDERED:
                self._rendered.popitem(last=False)
        return manifest, rendered

    def render_graft(self, digest: Digest) -> bytes:
        return self.graft(digest)[1]

    def graft_manifest(self, digest: Digest) -> Manifest:
        return self.graft(digest)[0]

    def attestation_homes(self, artifact: Digest) -> dict[int, frozenset[str]]:
        return attestation_homes(self.catalog, artifact)

    def attestations(self, artifact: Digest,
                     within: str | None = None) -> list[RenderedAttestation]:
        """The graft's attestations (provenance, verification, signatures) as OCI
        manifests whose subject is its OCI manifest; those recorded in repository
        `within` only, when given."""
        _, rendered = self.graft(artifact)
        subject = ocigraft.oci_digest(rendered)
        homes = self.attestation_homes(artifact) if within is not None else {}
        out = []
        for a in self.catalog.attestations(artifact):
            assert a.id is not None
            if within is not None and within not in homes.get(a.id, ()):
                continue
            raw, blob = ocigraft.render_attestation(a.statement, a.envelope, a.predicate_type,
                                                  a.keyid, a.id, subject, len(rendered))
            doc = json.loads(raw)
            att = RenderedAttestation(a.id, raw, ocigraft.oci_digest(raw), doc["artifactType"],
                                      doc["annotations"], blob,
                                      doc["layers"][0]["digest"])
            with self._lock:
                known = att.digest in self._remembered
            if not known:
                self.oci.remember(att.digest, "attestation", str(artifact), a.id)
                self.oci.remember(att.blob_digest, "attestation-blob", str(artifact), a.id)
                with self._lock:
                    self._remembered.add(att.digest)
            out.append(att)
        return out

    def attestation(self, repository: str, digest: str, kind: str,
                    ) -> RenderedAttestation | None:
        """The attestation whose OCI manifest (kind `attestation`) or layer
        (`attestation-blob`) is `digest`, if its graft is in `repository`."""
        found = self.oci.rendered(repository, digest, kind)
        if found is None:
            return None
        artifact, att_id = found
        for att in self.attestations(Digest.parse(artifact), within=repository):
            if att.id == att_id:
                return att
        return None

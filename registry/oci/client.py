"""A small client of the OCI distribution API (spec v1.1), enough to mirror a graft into a
registry teams already run (CNCF Distribution, Harbor, a cloud registry, `kvgraft serve`)
and back: blob HEAD, monolithic upload (POST then PUT), manifest PUT and GET, blob GET.

Credentials are answered the way the registry asks for them (`WWW-Authenticate`): Basic
with the user and secret, or the Distribution token flow (the realm is asked, with Basic
credentials when there are some, for a bearer token for the scope). Every read is bounded
by the size the caller expects and hashed on the way; a redirect (a registry that hands out
presigned storage URLs) is followed without the credentials when it leaves the registry.
All of it goes through kvgraft.remote.transport, whose one map types the errors:
unreachable 7 (Unavailable), refused credentials 8 (AuthRefused), wrong bytes 4
(IntegrityError), missing 3 (NotFound).
"""

from __future__ import annotations

import hashlib
import http.client
from dataclasses import dataclass
from urllib.parse import urlencode, urljoin

from kvgraft.digest import Buffer, Digest
from kvgraft.errors import IntegrityError, RegistryError, UsageError
from kvgraft.reference import check_name, check_tag
from kvgraft.remote.transport import (
    TIMEOUT,
    Challenged,
    Credentials,
    Peer,
    Transport,
    unreachable,
)

__all__ = ["MAX_MANIFEST", "OCI_MANIFEST", "Credentials", "OciClient", "OciLocation"]

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MAX_MANIFEST = 4 << 20  # what Distribution itself accepts
_SCHEMES = {"oci": "https", "https": "https", "oci+http": "http", "http": "http"}
REGISTRY = Peer(
    name="the OCI registry", short="the registry",
    credentials_hint="pass a token or password the registry accepts (--token-file) with "
                     "the scope",
    store_hint="check the clocks here and at the registry's storage",
    store_reach_hint="the registry hands out storage URLs this machine cannot reach")


@dataclass(frozen=True, slots=True)
class OciLocation:
    """`oci://host[:port]/repository[:tag]`: a repository in an OCI registry.

    `oci://` and `https://` speak HTTPS; `oci+http://` and `http://` plain HTTP (a registry
    on loopback or behind a trusted network)."""

    scheme: str  # http or https
    netloc: str  # host[:port]
    repository: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> OciLocation:
        scheme, sep, rest = text.partition("://")
        if not sep or scheme not in _SCHEMES:
            raise UsageError(f"not an OCI registry URL: {text!r}",
                             hint="use oci://host[:port]/repository[:tag] (oci+http:// for "
                                  "plain HTTP)")
        netloc, slash, path = rest.partition("/")
        if not netloc or not slash or not path:
            raise UsageError(f"{text!r} names no repository",
                             hint="use oci://host[:port]/repository[:tag]")
        repository, colon, tag = path.partition(":")
        return cls(_SCHEMES[scheme], netloc, check_name(repository),
                   check_tag(tag) if colon else "latest")

    @property
    def registry_url(self) -> str:
        return f"{self.scheme}://{self.netloc}"

    def __str__(self) -> str:
        return f"{self.registry_url}/{self.repository}:{self.tag}"


class OciClient:
    """One registry (scheme + host[:port]); thread-safe (connections are pooled)."""

    def __init__(self, registry_url: str, credentials: Credentials | None = None, *,
                 timeout: float = TIMEOUT) -> None:
        self.credentials = credentials
        self.transport = Transport(registry_url, REGISTRY, auth=Challenged(credentials),
                                   timeout=timeout)
        self.url = self.transport.url

    def close(self) -> None:
        self.transport.close()

    def _scope(self, repository: str, action: str) -> str:
        return f"repository:{repository}:{'pull,push' if action == 'push' else 'pull'}"

    # --- the API ----------------------------------------------------------------------

    def blob_exists(self, repository: str, digest: Digest, size: int) -> bool:
        what = f"HEAD blob {digest} at {self.url}"
        with self.transport.request("HEAD", f"/v2/{repository}/blobs/{digest}", what=what,
                                    scope=self._scope(repository, "pull")) as r:
            if r.status == 404:
                return False
            length = r.expect((200,), what).header("Content-Length")
        # A blob of another size under that digest is not the one we would push.
        return length is None or not length.isdigit() or int(length) == size

    def put_blob(self, repository: str, digest: Digest, data: Buffer) -> None:
        """Monolithic upload: POST opens it, one PUT carries the bytes and the digest."""
        scope = self._scope(repository, "push")
        what = f"open an upload for {digest} at {self.url}"
        with self.transport.request("POST", f"/v2/{repository}/blobs/uploads/", body=b"",
                                    what=what, scope=scope) as r:
            location = r.expect((202,), what).header("Location")
        if not location:
            raise RegistryError(f"{self.url} opened an upload without a Location")
        target = urljoin(self.url + "/", location)
        sep = "&" if "?" in target else "?"
        what = f"upload of blob {digest} to {self.url}"
        with self.transport.request(
                "PUT", f"{target}{sep}{urlencode({'digest': str(digest)})}", body=data,
                headers={"Content-Type": "application/octet-stream"}, what=what,
                scope=scope) as r:
            r.expect((201,), what)

    def put_manifest(self, repository: str, tag: str, body: bytes, media_type: str) -> Digest:
        digest = Digest.of(body)
        what = f"manifest PUT of {repository}:{tag} to {self.url}"
        with self.transport.request("PUT", f"/v2/{repository}/manifests/{tag}", body=body,
                                    headers={"Content-Type": media_type}, what=what,
                                    scope=self._scope(repository, "push")) as r:
            answered = r.expect((201,), what).header("Docker-Content-Digest")
        if answered and answered != str(digest):
            raise IntegrityError(f"{self.url} stored the manifest of {repository}:{tag} as "
                                 f"{answered}, expected {digest}")
        return digest

    def get_manifest(self, repository: str, reference: str, accept: str = OCI_MANIFEST,
                     ) -> tuple[bytes, Digest]:
        what = f"manifest {repository}:{reference} at {self.url}"
        with self.transport.request("GET", f"/v2/{repository}/manifests/{reference}",
                                    headers={"Accept": accept}, what=what,
                                    scope=self._scope(repository, "pull")) as r:
            answered = r.expect((200,), what).header("Docker-Content-Digest")
            body = r.read(MAX_MANIFEST, what)
        digest = Digest.of(body)
        for claimed in (answered, reference if reference.startswith("sha256:") else None):
            if claimed and claimed != str(digest):
                raise IntegrityError(f"manifest {repository}:{reference} from {self.url} "
                                     f"hashes to {digest}, not {claimed}")
        return body, digest

    def get_blob(self, repository: str, digest: Digest, size: int) -> bytes:
        """The blob's bytes, exactly `size` of them, hashed while they arrive."""
        what = f"blob {digest} from {self.url}"
        h = hashlib.sha256()
        out = bytearray()
        with self.transport.request("GET", f"/v2/{repository}/blobs/{digest}", what=what,
                                    scope=self._scope(repository, "pull")) as r:
            r.expect((200,), what)
            try:
                for piece in r.pieces(limit=size + 1):
                    h.update(piece)
                    out += piece
            except (OSError, http.client.HTTPException) as e:
                raise unreachable(r.url, self.url, REGISTRY, what, e) from None
        if len(out) != size:
            raise IntegrityError(f"{what} is {'longer' if len(out) > size else 'shorter'} "
                                 f"than its {size} bytes")
        digest.check(Digest.from_hasher(h), what)
        return bytes(out)

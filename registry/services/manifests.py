"""Reading manifests: through the machine cache for use, or straight from the catalog for
a check (which must see what the catalog holds now). Each is parsed, so it hashed to its
digest before anyone sees it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError

if TYPE_CHECKING:
    from kvgraft.formats.manifest import Manifest
    from kvgraft.services.backends import Backends

_KEPT = 64


class Manifests:
    def __init__(self, backends: Backends) -> None:
        self.backends = backends
        # Parsed manifests: a digest names immutable content (one is kept only after it
        # hashed to its digest), and schema validation costs more than the rest of a small
        # graft's load.
        self._parsed: dict[Digest, Manifest] = {}

    def get(self, digest: Digest) -> Manifest:
        """The manifest for use: from the cache, else the catalog (and cached)."""
        manifest = self._parsed.get(digest)
        if manifest is None:
            manifest = self._read(digest)
            if len(self._parsed) >= _KEPT:
                self._parsed.pop(next(iter(self._parsed)))
            self._parsed[digest] = manifest
        return manifest

    def _read(self, digest: Digest) -> Manifest:
        from kvgraft.formats.manifest import Manifest

        cache = self.backends.cache
        cached = cache.get_manifest(digest)
        if cached is not None:
            return Manifest.parse(cached, digest)
        raw = self.backends.uncached_manifest(digest)
        try:
            manifest = Manifest.parse(raw, digest)
        except IntegrityError as e:
            raise IntegrityError(f"catalog manifest of {digest} is corrupt: {e.message}") from None
        cache.put_manifest(digest, raw)
        return manifest

    def from_catalog(self, digest: Digest) -> Manifest:
        """The manifest as the catalog holds it now (no cache): it must hash to `digest`."""
        from kvgraft.formats.manifest import Manifest

        try:
            return Manifest.parse(self.backends.stored_manifest(digest), digest)
        except IntegrityError as e:
            raise IntegrityError(f"catalog manifest of {digest} is corrupt: {e.message}",
                                 hint="run `kvgraft audit` on it") from None

"""Where a Registry's catalog, blobs and cache are: settled once, when it is made.

Three kinds, one interface: `Direct` (a catalog URL and a store URL), `Served` (a `kvgraft
serve` reached with a token: its HTTP catalog, and each repository's blobs through it) and
`Offline` (the machine cache alone). The services ask for what they need (a catalog, the
store holding a repository's blobs, a place to record an event) and never which kind they
have: the differences live here, each in one place.

Nothing is opened until first used, so `kvgraft ls` and `--version` load no more than
they need: the catalog's SQL, the stores and the HTTP client are imported by the methods
that open them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from kvgraft.config import Config
from kvgraft.digest import Digest
from kvgraft.errors import NotFound, UsageError
from kvgraft.reference import Reference

if TYPE_CHECKING:
    from kvgraft.blobstore import BlobStore
    from kvgraft.catalog import Catalog
    from kvgraft.catalog.api import CatalogAPI, TagListing
    from kvgraft.catalog.reader import CatalogReader
    from kvgraft.catalog.records import BlobRecord, EventRecord
    from kvgraft.formats.manifest import Manifest
    from kvgraft.remote.catalog import HttpCatalog
    from kvgraft.remote.http import HttpRemote
    from kvgraft.services.prefixindex import PrefixIndex
    from kvgraft.transfer.cache import Cache

Reupload = Callable[[], "Iterable[BlobRecord]"]


class Backends(Protocol):
    config: Config

    @property
    def cache(self) -> Cache: ...

    @property
    def catalog(self) -> CatalogAPI: ...

    def listing(self) -> TagListing | None:
        """What lists tags (None: a registry never written to, which a listing must not
        create)."""

    def blobs(self, repository: str | None = None, digest: Digest | None = None,
              ) -> BlobStore:
        """The store holding the blobs of `repository` (or, when none is named, of the
        artifact `digest`)."""

    def fetch_store(self, repository: str | None, digest: Digest) -> BlobStore | None:
        """Where a fetch reads the blobs the cache lacks (None: the cache alone)."""

    def whole_store(self, what: str, alternative: str) -> BlobStore:
        """The store itself, for what only its owner may do (gc, repair, raw listing)."""

    def whole_catalog(self, what: str, alternative: str) -> Catalog:
        """The SQL catalog itself, for what only its owner may do (gc)."""

    def owner_only(self, what: str, alternative: str) -> None:
        """Refuse `what` unless this is the catalog and store themselves (db, tokens)."""

    def resolve(self, ref: Reference) -> Digest: ...

    def stored_manifest(self, digest: Digest) -> bytes:
        """The manifest bytes the catalog holds for `digest` (unchecked)."""

    def uncached_manifest(self, digest: Digest) -> bytes:
        """Where a manifest the machine cache lacks comes from: the catalog's copy."""

    def policy_catalog(self, what: str) -> CatalogAPI:
        """The catalog the policy reads signatures and verifications from."""

    def record(self, event: EventRecord) -> None: ...

    def ensure_blobs(self, manifest: Manifest, reupload: Reupload) -> None:
        """After a commit: store again what a concurrent gc deleted (kvgraft.transfer.gc)."""

    def prefix_index(self) -> PrefixIndex: ...

    def require_online(self, what: str) -> None: ...

    def close(self) -> None: ...


def open_backends(config: Config) -> Backends:
    if config.offline:
        return Offline(config)
    if config.server_url is not None:
        return Served(config)
    return Direct(config)


def offline_refusal(what: str) -> UsageError:
    return UsageError(
        f"this needs {what}, and kvgraft is offline (--offline or KVGRAFT_OFFLINE)",
        hint="offline, `pull` serves from the cache and `cache ls` lists it; "
             "drop --offline for everything else")


def served_refusal(config: Config, what: str, alternative: str) -> UsageError:
    return UsageError(f"{what} cannot run through the kvgraft server {config.server_url} "
                      f"(remote {config.remote!r})", hint=alternative)


class _Cached:
    def __init__(self, config: Config) -> None:
        self.config = config
        self._cache: Cache | None = None

    @property
    def cache(self) -> Cache:
        if self._cache is None:
            from kvgraft.transfer.cache import Cache

            self._cache = Cache(self.config.cache_dir)
        return self._cache

    def require_online(self, what: str) -> None:
        pass  # a catalog and a store are within reach

    def fetch_store(self, repository: str | None, digest: Digest) -> BlobStore | None:
        return self.blobs(repository, digest)

    def blobs(self, repository: str | None = None, digest: Digest | None = None,
              ) -> BlobStore:
        raise NotImplementedError

    def stored_manifest(self, digest: Digest) -> bytes:
        raise NotImplementedError

    def uncached_manifest(self, digest: Digest) -> bytes:
        return self.stored_manifest(digest)

    def close(self) -> None:
        pass


class _Online(_Cached):
    """What a catalog within reach answers the same way, SQL or served."""

    @property
    def catalog(self) -> CatalogAPI:
        raise NotImplementedError

    def resolve(self, ref: Reference) -> Digest:
        return self.catalog.resolve(ref)

    def stored_manifest(self, digest: Digest) -> bytes:
        return self.catalog.artifact(digest).manifest

    def policy_catalog(self, what: str) -> CatalogAPI:
        return self.catalog

    def record(self, event: EventRecord) -> None:
        self.catalog.add_event(event)


class Direct(_Online):
    """The catalog and the store themselves."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._catalog: Catalog | None = None
        self._reader: CatalogReader | None = None
        self._store: BlobStore | None = None

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            from kvgraft.catalog import Catalog

            if self._reader is not None:  # opened (its schema checked) for a listing
                self._catalog = Catalog.from_reader(self._reader)
            else:
                self._catalog = Catalog.open(self.config.catalog_url,
                                             auto_upgrade=self.config.embedded)
        return self._catalog

    @property
    def reader(self) -> CatalogReader:
        """The catalog for reads that need no ORM: what `kvgraft ls` loads. The full
        catalog, opened before or after, shares its engine."""
        if self._catalog is not None:
            return self._catalog
        if self._reader is None:
            from kvgraft.catalog.reader import CatalogReader

            self._reader = CatalogReader.open(self.config.catalog_url,
                                              auto_upgrade=self.config.embedded)
        return self._reader

    @property
    def opened(self) -> tuple[str, ...]:
        """Which of the catalog's handles are open (the startup tests check it)."""
        return tuple(n for n, h in (("catalog", self._catalog), ("reader", self._reader))
                     if h is not None)

    def listing(self) -> TagListing | None:
        if self.config.embedded and not self.opened and \
                not (self.config.home / "catalog.db").exists():
            return None
        return self.reader

    @property
    def store(self) -> BlobStore:
        if self._store is None:
            from kvgraft.blobstore import open_store

            self._store = open_store(self.config.blob_url)
        return self._store

    def blobs(self, repository: str | None = None, digest: Digest | None = None,
              ) -> BlobStore:
        return self.store

    def whole_store(self, what: str, alternative: str) -> BlobStore:
        return self.store

    def whole_catalog(self, what: str, alternative: str) -> Catalog:
        return self.catalog

    def owner_only(self, what: str, alternative: str) -> None:
        pass

    def ensure_blobs(self, manifest: Manifest, reupload: Reupload) -> None:
        from kvgraft.transfer.gc import ensure_blobs

        ensure_blobs(self.catalog, self.store, manifest, reupload)

    def prefix_index(self) -> PrefixIndex:
        from kvgraft.services.prefixindex import CatalogPrefixIndex

        return CatalogPrefixIndex(self.catalog)

    def close(self) -> None:
        for handle in (self._catalog, self._reader):  # one engine: disposing twice is harmless
            if handle is not None:
                handle.close()


class Served(_Online):
    """A `kvgraft serve`: its catalog API, and each repository's blobs through it (the
    token's scopes decide what may be read and written)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._remote: HttpRemote | None = None
        self._catalog: HttpCatalog | None = None

    @property
    def remote(self) -> HttpRemote:
        if self._remote is None:
            from kvgraft.remote.http import HttpRemote

            assert self.config.server_url is not None
            if self.config.token_file is None:
                raise UsageError(f"remote {self.config.remote!r} names no token file",
                                 hint="kvgraft remote add NAME URL --token-file F")
            self._remote = HttpRemote.with_token_file(self.config.server_url,
                                                      self.config.token_file)
        return self._remote

    @property
    def catalog(self) -> HttpCatalog:
        if self._catalog is None:
            self._catalog = self.remote.catalog()
        return self._catalog

    def listing(self) -> TagListing | None:
        return self.catalog  # the server lists what the token may see

    def blobs(self, repository: str | None = None, digest: Digest | None = None,
              ) -> BlobStore:
        if not repository and digest is not None:
            # the first repository holding the artifact that the token may read
            visible = self.catalog.artifact(digest).repositories
            repository = visible[0] if visible else None
        if not repository:
            raise UsageError("through a kvgraft server, blobs are reached by repository",
                             hint="name the artifact by name:tag or name@digest")
        return self.remote.store(repository)

    def whole_store(self, what: str, alternative: str) -> BlobStore:
        raise served_refusal(self.config, what, alternative)

    def whole_catalog(self, what: str, alternative: str) -> Catalog:
        raise served_refusal(self.config, what, alternative)

    def owner_only(self, what: str, alternative: str) -> None:
        raise served_refusal(self.config, what, alternative)

    def ensure_blobs(self, manifest: Manifest, reupload: Reupload) -> None:
        pass  # the server checks its own gc history when it commits the push

    def prefix_index(self) -> PrefixIndex:
        from kvgraft.services.prefixindex import ServerPrefixIndex

        return ServerPrefixIndex(self.remote)


class Offline(_Cached):
    """The machine cache alone: no catalog or store access at all. Every path to them
    passes through here, so a command that needs them is refused before it reads or
    writes anything."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        # What offline stands in for, settled once: a server remote, or a catalog and a
        # store. What only their owner may do is refused through a server, online or not.
        self._catalog_name, self._store_name = "the catalog", "the blob store"
        self._owner_only: Callable[[str, str, str], UsageError] = \
            lambda what, alt, needed: offline_refusal(needed)
        if config.server_url is not None:
            self._catalog_name = self._store_name = "the server"
            self._owner_only = lambda what, alt, needed: served_refusal(config, what, alt)

    def require_online(self, what: str) -> None:
        raise offline_refusal(what)

    @property
    def catalog(self) -> CatalogAPI:
        raise offline_refusal(self._catalog_name)

    def listing(self) -> TagListing | None:
        raise offline_refusal(self._catalog_name)

    def blobs(self, repository: str | None = None, digest: Digest | None = None,
              ) -> BlobStore:
        raise offline_refusal(self._store_name)

    def fetch_store(self, repository: str | None, digest: Digest) -> BlobStore | None:
        return None

    def whole_store(self, what: str, alternative: str) -> BlobStore:
        raise self._owner_only(what, alternative, "the blob store")

    def whole_catalog(self, what: str, alternative: str) -> Catalog:
        raise self._owner_only(what, alternative, "the catalog")

    def owner_only(self, what: str, alternative: str) -> None:
        raise self._owner_only(what, alternative, "the catalog")

    def resolve(self, ref: Reference) -> Digest:
        digest = self.cache.get_ref(ref)
        if digest is None:
            raise NotFound(f"{ref} is not in the local cache (offline)",
                           hint="pull it once online first")
        return digest

    def stored_manifest(self, digest: Digest) -> bytes:
        raise offline_refusal(self._catalog_name)

    def uncached_manifest(self, digest: Digest) -> bytes:
        raise NotFound(f"manifest {digest} is not in the local cache (offline)")

    def policy_catalog(self, what: str) -> CatalogAPI:
        from kvgraft.provenance import PolicyRefused

        raise PolicyRefused(f"cannot check the signing/verification policy for {what} "
                            "offline (it needs the catalog)")

    def record(self, event: EventRecord) -> None:
        # Only a pull from the cache completes offline (every other act needs the catalog
        # first); its event has no catalog to go to.
        pass

    def ensure_blobs(self, manifest: Manifest, reupload: Reupload) -> None:
        raise offline_refusal(self._catalog_name)

    def prefix_index(self) -> PrefixIndex:
        raise offline_refusal(self._catalog_name)

"""The Registry facade: what the CLI and integrations call. Wires config, store, catalog
and cache together and writes an audit event for every change."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgraft.catalog import ArtifactRecord, EventRecord, PushRecord, TagRecord
from kvgraft.catalog.records import AttestationRecord, BlobRecord
from kvgraft.config import Config, actor
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, NotFound, RegistryError, UsageError
from kvgraft.identity.model import ModelIdentity
from kvgraft.reference import Reference, check_name

# The data path (codecs and numpy, manifest schemas, the stores) is imported by the
# methods that use it: `kvgraft ls` and the like load only the catalog.
if TYPE_CHECKING:
    from kvgraft.blobstore import BlobStore
    from kvgraft.catalog import Catalog
    from kvgraft.catalog.reader import CatalogReader
    from kvgraft.formats.manifest import Manifest
    from kvgraft.provenance import Keyring, Statement
    from kvgraft.provenance.audit import AuditReport
    from kvgraft.remote.http import HttpRemote
    from kvgraft.transfer.cache import Cache
    from kvgraft.transfer.copy import CopyStats
    from kvgraft.transfer.gc import GcPlan, GcResult
    from kvgraft.transfer.pull import Fetcher, FetchStats, Progress
    from kvgraft.transfer.push import PushOptions
    from kvgraft.transfer.verify import VerifyReport

_LABEL_KEY_MAX = 255
_MANIFESTS_MAX = 64


@dataclass(frozen=True, slots=True)
class PushResult:
    digest: Digest
    reference: Reference
    created: bool
    blobs_stored: int
    bytes_stored: int
    size: int
    stored_size: int
    token_count: int
    previous: Digest | None
    warnings: tuple[str, ...] = ()  # what failed after the commit (the push stands)


@dataclass(frozen=True, slots=True)
class PullResult:
    digest: Digest
    reference: Reference
    output: Path | None
    stats: FetchStats
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class OpenedArtifact:
    """An artifact the policy accepted for use: its manifest and a fetcher that reads its
    blobs through the machine cache (from the store when missing), each verified."""

    reference: Reference | None  # None when opened by bare digest
    digest: Digest
    manifest: Manifest
    fetcher: Fetcher


@dataclass(frozen=True, slots=True)
class Inspection:
    record: ArtifactRecord
    manifest: Manifest
    chunks: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        r, m = self.record, self.manifest
        return {
            "digest": str(r.digest), "size": r.size, "stored_size": r.stored_size,
            "token_count": m.token_count, "created_at": r.created_at.isoformat(),
            "model": {**m.model.to_json(), "name": m.model_name},
            "repositories": list(r.repositories),
            "tags": [f"{t.repository}:{t.tag}" for t in r.tags],
            "labels": dict(r.labels), "chunks": [dict(c) for c in self.chunks],
            "manifest": m.to_json(),
        }


def _best_effort(what: str, fn: Callable[[], object]) -> tuple[str, ...]:
    """Run `fn`; a failure becomes a warning line instead of an error."""
    try:
        fn()
    except (OSError, RegistryError) as e:
        why = e.message if isinstance(e, RegistryError) else (e.strerror or str(e))
        return (f"{what} failed: {why}",)
    return ()


def check_labels(labels: Mapping[str, str]) -> dict[str, str]:
    for key, value in labels.items():
        if not key or len(key) > _LABEL_KEY_MAX or not key.isprintable():
            raise UsageError(f"invalid label key {key!r}")
        # PostgreSQL text cannot hold NUL; a lone surrogate (undecodable bytes in argv)
        # cannot be stored as UTF-8 anywhere. Refused before any blob is uploaded.
        if "\0" in value or not _utf8(value):
            raise UsageError(f"invalid value for label {key!r}: it holds NUL or bytes that "
                             "are not UTF-8")
    return dict(labels)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_output(output: Path) -> None:
    """`-o ''` (which a Path reads as '.') and other names that cannot be a file."""
    if output.name in ("", ".", ".."):
        raise UsageError(f"the output must name a file, not {str(output)!r}",
                         hint="an empty name, '.' or '..' names none")


class Registry:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.user, self.host = actor()
        # Parsed manifests: a digest names immutable content (one is kept only after it
        # hashed to its digest), and schema validation costs more than the rest of a small
        # graft's load.
        self._manifests: dict[Digest, Manifest] = {}

    @classmethod
    def from_env(cls, *, remote: str | None = None, **overrides: object) -> Registry:
        return cls(Config.from_env(None, remote=remote, **overrides))

    @cached_property
    def http(self) -> HttpRemote | None:
        """The `kvgraft serve` remote this registry reaches through, if it is one."""
        if self.config.server_url is None:
            return None
        from kvgraft.remote.http import HttpRemote

        if self.config.token_file is None:
            raise UsageError(f"remote {self.config.remote!r} names no token file",
                             hint="kvgraft remote add NAME URL --token-file F")
        return HttpRemote.with_token_file(self.config.server_url, self.config.token_file)

    def direct_only(self, what: str, alternative: str) -> None:
        """Refuse what only the catalog and store themselves can do (gc, repair, listing
        raw blobs) when they sit behind a server."""
        if self.config.server_url is not None:
            raise UsageError(f"{what} cannot run through the kvgraft server "
                             f"{self.config.server_url} (remote {self.config.remote!r})",
                             hint=alternative)

    @cached_property
    def store(self) -> BlobStore:
        """The blob store itself; through a server, blobs are reached per repository
        (`blob_store`), so this is refused there."""
        self.direct_only("raw blob store access",
                         "run it on the server's host with a direct remote (--catalog, "
                         "--store)")
        self.require_online("the blob store")
        from kvgraft.blobstore import open_store

        return open_store(self.config.blob_url)

    def blob_store(self, repository: str | None) -> BlobStore:
        """Where the blobs of `repository` are read and written: the store, or through a
        server the repository's blobs (authorised by the token's scope on it)."""
        if self.http is None:
            return self.store
        self.require_online("the server")
        if not repository:
            raise UsageError("through a kvgraft server, blobs are reached by repository",
                             hint="name the artifact by name:tag or name@digest")
        return self.http.store(repository)

    @cached_property
    def catalog(self) -> Catalog:
        if self.http is not None:
            self.require_online("the server")
            return self.http.catalog()  # type: ignore[return-value]
        from kvgraft.catalog import Catalog

        reader = self.__dict__.get("catalog_reader")
        if reader is not None:  # opened (and its schema checked) for a listing already
            return Catalog.from_reader(reader)
        self.require_online("the catalog")
        return Catalog.open(self.config.catalog_url, auto_upgrade=self.config.embedded)

    @cached_property
    def catalog_reader(self) -> CatalogReader:
        """The catalog for reads that need no ORM (listing tags): what `kvgraft ls` loads.
        The full `catalog`, opened before or after, shares its engine."""
        if "catalog" in self.__dict__ or self.http is not None:
            return self.catalog  # through a server, the HTTP catalog lists tags too
        self.require_online("the catalog")
        from kvgraft.catalog.reader import CatalogReader

        return CatalogReader.open(self.config.catalog_url, auto_upgrade=self.config.embedded)

    def require_online(self, what: str) -> None:
        """Offline means no catalog or store access at all: every path to them passes here,
        so a command that needs them is refused before it reads or writes anything."""
        if self.config.offline:
            raise UsageError(
                f"this needs {what}, and kvgraft is offline (--offline or KVGRAFT_OFFLINE)",
                hint="offline, `pull` serves from the cache and `cache ls` lists it; "
                     "drop --offline for everything else")

    @cached_property
    def cache(self) -> Cache:
        from kvgraft.transfer.cache import Cache

        return Cache(self.config.cache_dir)

    def close(self) -> None:
        for name in ("catalog", "catalog_reader"):  # one engine, disposing twice is harmless
            if name in self.__dict__:
                self.__dict__[name].close()

    def _event(self, action: str, **kw: Any) -> EventRecord:
        return EventRecord(action=action, actor=f"{self.user}@{self.host}", host=self.host, **kw)

    # --- writes ------------------------------------------------------------------------

    def push(self, path: str | Path, ref: Reference | str, *,
             labels: Mapping[str, str] | None = None, options: PushOptions | None = None,
             progress: Progress | None = None) -> PushResult:
        from kvgraft.transfer.push import PushOptions, build_artifact

        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        if ref.digest is not None:
            raise UsageError(f"push takes name[:tag], not a digest: {ref}")
        labels = check_labels(labels or {})
        options = options or PushOptions()
        for parent in options.parents:
            if not self.catalog.has_artifact(parent):
                raise NotFound(f"parent artifact {parent} is not in the catalog")
        store = self.blob_store(ref.name)
        upload = build_artifact(path, store, options, progress)
        m = upload.manifest
        event = self._event("push", repository=ref.name, tag=ref.tag, digest=m.digest,
                            detail={"blobs_stored": upload.stored,
                                    "bytes_stored": upload.stored_bytes})
        outcome = self.catalog.record_push(PushRecord(
            m, upload.blobs, ref.name, ref.tag, labels, event))
        if upload.repaired:  # the rows may describe the corrupt objects' encoding
            self.catalog.refresh_blobs(upload.repaired)
        self._ensure_blobs(m, lambda: build_artifact(path, store, options).blobs)
        # The push is committed: remembering it in this machine's cache is a convenience
        # (for --offline), so a full or broken cache is a warning, not a failed push.
        def remember() -> None:
            self.cache.put_manifest(m.digest, m.canonical())
            self.cache.put_ref(ref, m.digest)

        warnings = _best_effort(f"caching {ref}", remember)
        return PushResult(m.digest, ref, outcome.created, upload.stored, upload.stored_bytes,
                          m.size, sum(b.stored_size for b in upload.blobs), m.token_count,
                          outcome.previous, warnings)

    def tag(self, src: Reference | str, dst: Reference | str) -> Digest:
        src = Reference.parse(src) if isinstance(src, str) else src
        dst = Reference.parse(dst) if isinstance(dst, str) else dst
        if dst.tag is None:
            raise UsageError(f"the new reference must name a tag: {dst}")
        digest = self.resolve(src)
        self.catalog.set_tag(dst.name, dst.tag, digest,
                             self._event("tag", repository=dst.name, tag=dst.tag, digest=digest,
                                         detail={"source": str(src)}))
        return digest

    def untag(self, ref: Reference | str) -> Digest:
        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        if ref.tag is None:
            raise UsageError(f"untag takes name:tag, not a digest: {ref}")
        return self.catalog.remove_tag(ref.name, ref.tag,
                                       self._event("untag", repository=ref.name, tag=ref.tag))

    # --- reads -------------------------------------------------------------------------

    def resolve(self, ref: Reference | str) -> Digest:
        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        if self.config.offline:
            digest = self.cache.get_ref(ref)
            if digest is None:
                raise NotFound(f"{ref} is not in the local cache (offline)",
                               hint="pull it once online first")
            return digest
        return self.catalog.resolve(ref)

    def manifest(self, digest: Digest) -> Manifest:
        manifest = self._manifests.get(digest)
        if manifest is None:
            manifest = self._read_manifest(digest)
            if len(self._manifests) >= _MANIFESTS_MAX:
                self._manifests.pop(next(iter(self._manifests)))
            self._manifests[digest] = manifest
        return manifest

    def _read_manifest(self, digest: Digest) -> Manifest:
        from kvgraft.formats.manifest import Manifest

        cached = self.cache.get_manifest(digest)
        if cached is not None:
            return Manifest.parse(cached, digest)
        if self.config.offline:
            raise NotFound(f"manifest {digest} is not in the local cache (offline)")
        raw = self.catalog.artifact(digest).manifest
        try:
            manifest = Manifest.parse(raw, digest)
        except IntegrityError as e:
            raise IntegrityError(f"catalog manifest of {digest} is corrupt: {e.message}") from None
        self.cache.put_manifest(digest, raw)
        return manifest

    def open(self, ref: Reference | Digest | str, *, require_signed_by: Sequence[str] = (),
             require_verified: bool = False, model: ModelIdentity | None = None,
             for_verification: bool = False, action: str = "load") -> OpenedArtifact:
        """The one way to open an artifact for use: resolve `ref`, read its manifest,
        enforce the policy (`check_policy`), and hand back a fetcher reading its blobs
        through the machine cache. Every path that hands KV to a model goes through here."""
        from kvgraft.transfer.pull import Fetcher

        reference = _as_reference(ref)
        digest = ref if isinstance(ref, Digest) else self.resolve(ref)
        manifest = self.manifest(digest)
        self.check_policy(reference or digest, manifest, require_signed_by=require_signed_by,
                          require_verified=require_verified, model=model,
                          for_verification=for_verification, action=action)
        store = None
        if not self.config.offline:
            repository = reference.name if reference is not None else None
            if repository is None and self.http is not None:
                visible = self.catalog.artifact(digest).repositories
                repository = visible[0] if visible else None
            store = self.blob_store(repository)
        fetcher = Fetcher(store, self.cache)
        return OpenedArtifact(reference, digest, manifest, fetcher)

    def pull(self, ref: Reference | str, output: Path | None = None, *,
             progress: Progress | None = None, workers: int | None = None,
             require_signed_by: Sequence[str] = (),
             require_verified: bool | ModelIdentity = False) -> PullResult:
        """`require_signed_by` (keyids or key names, any one) and `require_verified` (True:
        for the graft's own model; or the live model's identity) add to the [policy] of
        config.toml; a refused pull raises PolicyRefused (exit 4) and is logged."""
        if output is not None:
            check_output(output)
        from kvgraft.transfer.pull import export, fetch

        opened = self.open(ref, require_signed_by=require_signed_by,
                           require_verified=bool(require_verified),
                           model=require_verified if isinstance(require_verified, ModelIdentity)
                           else None, action="pull")
        digest, manifest = opened.digest, opened.manifest
        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        if output is None:
            stats = fetch(manifest, opened.fetcher, workers=workers, progress=progress)
        else:
            stats = export(manifest, opened.fetcher, output, workers=workers, progress=progress)
        if self.config.offline:
            return PullResult(digest, ref, output, stats)  # no catalog to log to
        warnings = _best_effort(f"remembering {ref} in the cache",
                                lambda: self.cache.put_ref(ref, digest))
        self.catalog.add_event(self._event(
            "pull", repository=ref.name, tag=ref.tag, digest=digest,
            detail={"fetched": stats.fetched, "fetched_bytes": stats.fetched_bytes,
                    "output": str(output) if output else None}))
        return PullResult(digest, ref, output, stats, warnings)

    def copy(self, src: Reference | str, dst_registry: Registry, dst: Reference | str,
             ) -> tuple[Digest, CopyStats]:
        """Copy the artifact `src` names into `dst_registry` as `dst`; only missing blobs
        move. Labels come along; the copy is an event in both catalogs."""
        from kvgraft.formats.manifest import Manifest
        from kvgraft.transfer.copy import copy_blobs

        src = Reference.parse(src) if isinstance(src, str) else src
        dst = Reference.parse(dst) if isinstance(dst, str) else dst
        if dst.digest is not None and dst.digest != self.resolve(src):
            raise UsageError(f"{dst} names a different digest than {src}")
        digest = self.resolve(src)
        manifest = Manifest.parse(self.catalog.artifact(digest).manifest, digest)
        src_store, dst_store = self.blob_store(src.name), dst_registry.blob_store(dst.name)
        stats = copy_blobs(manifest, src_store, dst_store)
        labels = self.catalog.artifact(digest).labels
        detail = {"source": f"{self.config.remote or 'local'}:{src}",
                  "target": f"{dst_registry.config.remote or 'local'}:{dst}",
                  "blobs_copied": stats.copied, "bytes_copied": stats.copied_bytes}
        dst_registry.catalog.record_push(PushRecord(
            manifest, stats.blobs, dst.name, dst.tag, labels,
            dst_registry._event("copy", repository=dst.name, tag=dst.tag, digest=digest,
                                detail=detail)))
        dst_registry._ensure_blobs(
            manifest, lambda: copy_blobs(manifest, src_store, dst_store).blobs)
        self.catalog.add_event(self._event("copy", repository=src.name, tag=src.tag,
                                           digest=digest, detail=detail))
        return digest, stats

    def list(self, pattern: str | None = None, *,
             problems: list[str] | None = None) -> tuple[TagRecord, ...]:
        """Tags whose repository matches the shell glob `pattern` (`*`, `?`, `[seq]`,
        `[!seq]`). With `problems`, damaged tag rows are reported there, not raised."""
        if pattern and not any(ch in pattern for ch in "*?["):
            check_name(pattern)
        if self.http is None and self.config.embedded and "catalog" not in self.__dict__ and \
                "catalog_reader" not in self.__dict__ and \
                not (self.config.home / "catalog.db").exists():
            return ()  # a registry never written to: listing it should not create it
        tags = self.catalog_reader.list_tags(pattern, problems=problems)
        if pattern:
            tags = tuple(t for t in tags if fnmatch.fnmatchcase(t.repository, pattern))
        return tags

    def inspect(self, ref: Reference | str) -> Inspection:
        digest = self.resolve(ref)
        record = self.catalog.artifact(digest)
        manifest = self.manifest(digest)
        blobs = self.catalog.blob_records(c.digest for c in manifest.chunks)
        chunks = tuple({
            "index": c.index, "start": c.start, "end": c.end, "digest": str(c.digest),
            "size": c.size, "stored_size": blobs[c.digest].stored_size if c.digest in blobs
            else None, "codec": blobs[c.digest].codec if c.digest in blobs else None,
            "prefix": str(c.prefix)} for c in manifest.chunks)
        return Inspection(record, manifest, chunks)

    def verify(self, ref: Reference | str | None = None, *, workers: int | None = None,
               ) -> tuple[VerifyReport, ...]:
        from kvgraft.transfer.verify import VerifyReport, verify_artifact

        digests = [self.resolve(ref)] if ref is not None else self.catalog.artifact_digests()
        reports = []
        for digest in digests:
            try:  # a tampered manifest is reported with the rest, never ends the run
                manifest = self._catalog_manifest(digest)
            except IntegrityError as e:
                report = VerifyReport(digest, 0, 0, (), (e.message,))
            else:
                records = self.catalog.blob_records(b.digest for b in manifest.blobs())
                report = verify_artifact(manifest, self._store_of(digest), records,
                                         workers=workers)
            reports.append(report)
            self.catalog.add_event(self._event(
                "verify", digest=digest, outcome="ok" if report.ok else "failed",
                detail={"checked": report.checked,
                        "bad": [str(b.digest) for b in report.bad],
                        "problems": list(report.problems)}))
        return tuple(reports)

    def repair(self, report: VerifyReport, source: Path | None = None,
               ) -> Sequence[Digest]:
        """Replace the bad blobs of a failed verification with good bytes from `source`
        (the pushed KV file) or the cache; returns the digests that could not be repaired
        (verify again to see the outcome)."""
        from kvgraft.transfer import repair
        self.direct_only("repairing blobs", "run `kvgraft verify REF --repair` on the "
                         "server's host with a direct remote, or push the file again "
                         "through the server (a push replaces blobs that no longer verify)")
        manifest = self._catalog_manifest(report.artifact)
        bad = [b.digest for b in report.bad]
        left: Sequence[Digest] = ()
        if source is not None:
            fixed = repair.from_file(manifest, source, self.store)
        else:
            fixed, left = repair.from_cache(manifest, bad, self.store, self.cache)
        self.catalog.refresh_blobs(fixed)
        self.catalog.add_event(self._event(
            "repair", digest=report.artifact, outcome="ok" if not left else "failed",
            detail={"source": str(source) if source else "cache",
                    "repaired": [str(d) for d in bad if d not in left],
                    "unrepaired": [str(d) for d in left]}))
        return left

    def _store_of(self, digest: Digest, ref: Reference | str | None = None) -> BlobStore:
        """The store holding the blobs of `digest` (through a server: of the repository
        `ref` names, else the first one holding the artifact that the token may read)."""
        if self.http is None:
            return self.store
        if ref is not None:
            return self.blob_store((Reference.parse(ref) if isinstance(ref, str) else ref).name)
        visible = self.catalog.artifact(digest).repositories
        return self.blob_store(visible[0] if visible else None)

    def verify_tags(self) -> tuple[str, ...]:
        """Every tag that does not lead to an artifact: a malformed digest, or one the
        catalog holds no artifact for (the foreign key can be switched off in SQLite)."""
        problems: list[str] = []
        known = set(self.catalog.artifact_digests())
        for t in self.catalog.list_tags(problems=problems):
            if t.digest not in known:
                problems.append(f"tag {t.repository}:{t.tag} points at {t.digest}, which is "
                                "not in the catalog")
        return tuple(problems)

    # --- provenance, signatures, audit and gc ------------------------------------------

    @cached_property
    def keyring(self) -> Keyring:
        from kvgraft.provenance import Keyring

        return Keyring(self.config.home)

    def log(self, ref: Reference | str | None = None, *, since: datetime | None = None,
            action: str | None = None) -> tuple[EventRecord, ...]:
        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        # By digest even after gc removed the artifact: its history outlives it.
        digest = None if ref is None else ref.digest or self.resolve(ref)
        return tuple(self.catalog.events(digest=digest, action=action, since=since))

    def _catalog_manifest(self, digest: Digest) -> Manifest:
        """The manifest as the catalog holds it now (no cache): it must hash to `digest`."""
        from kvgraft.formats.manifest import Manifest

        try:
            return Manifest.parse(self.catalog.artifact(digest).manifest, digest)
        except IntegrityError as e:
            raise IntegrityError(f"catalog manifest of {digest} is corrupt: {e.message}",
                                 hint="run `kvgraft audit` on it") from None

    def provenance(self, ref: Reference | str,
                   ) -> tuple[Statement, tuple[AttestationRecord, ...]]:
        """The kvgraft provenance statement of the artifact `ref` names (derived from its
        manifest and first push), and the attestations stored about it."""
        from kvgraft.provenance import Statement, provenance_statement
        from kvgraft.provenance.audit import origin

        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        digest = self.resolve(ref)
        manifest = self._catalog_manifest(digest)
        statement = provenance_statement(manifest, origin(self.catalog.events(digest=digest)),
                                         name=ref.name)
        attestations = tuple(self.catalog.attestations(digest))
        for a in attestations:
            try:  # validated on read, like everything kvgraft hands out
                Statement.parse(a.statement)
            except IntegrityError as e:
                raise IntegrityError(f"attestation {a.id} of {digest} is invalid: {e.message}",
                                     hint="`kvgraft audit` shows every problem") from None
        return statement, attestations

    def sign(self, ref: Reference | str, key: str) -> tuple[Digest, str, int]:
        """Sign the provenance statement of `ref` with the keyring's key `key`; stores the
        DSSE envelope as an attestation. Returns (digest, keyid, attestation id)."""
        from kvgraft.provenance import PROVENANCE, sign_statement

        ref = Reference.parse(ref) if isinstance(ref, str) else ref
        signer = self.keyring.signer(key)
        statement, _ = self.provenance(ref)
        digest = statement.subjects[0].digest
        keyid: str = signer.public_key.keyid
        envelope = sign_statement(statement, signer)
        att = AttestationRecord(digest, PROVENANCE, statement.canonical(), envelope, keyid)
        event = self._event("sign", repository=ref.name, tag=ref.tag, digest=digest,
                            detail={"keyid": keyid, "key": key, "predicate_type": PROVENANCE,
                                    "statement_digest": str(statement.digest)})
        return digest, keyid, self.catalog.add_attestation(att, event)

    def attest(self, statement: Statement, *, event_action: str = "attest",
               detail: Mapping[str, Any] | None = None) -> int:
        """Store an (unsigned) statement about its subject artifact, with its event."""
        digest = statement.subjects[0].digest
        att = AttestationRecord(digest, statement.predicate_type, statement.canonical())
        event = self._event(event_action, digest=digest, detail={
            **(detail or {}), "predicate_type": statement.predicate_type,
            "statement_digest": str(statement.digest)})
        return self.catalog.add_attestation(att, event)

    def audit(self, ref: Reference | str, *, workers: int | None = None) -> AuditReport:
        from kvgraft.provenance.audit import audit

        digest = self.resolve(ref)
        return audit(self.catalog, self._store_of(digest, ref), digest, self.keyring.trusted(),
                     workers=workers)

    def gc_plan(self, *, grace: float | None = None,
                untagged_older_than: float | None = None) -> GcPlan:
        from kvgraft.transfer.gc import DEFAULT_GRACE, plan

        self.direct_only("gc", "run `kvgraft gc` on the server's host with a direct remote "
                         "(--catalog, --store): it needs the whole catalog and store")
        return plan(self.catalog, self.store,
                    grace=DEFAULT_GRACE if grace is None else grace,
                    untagged_older_than=untagged_older_than)

    def gc(self, gc_plan: GcPlan, *, allow_empty_catalog: bool = False) -> GcResult:
        from kvgraft.transfer.gc import execute

        self.direct_only("gc", "run `kvgraft gc` on the server's host with a direct remote")
        return execute(self.catalog, self.store, gc_plan,
                       self._event("gc", detail={"store": self.store.url}),
                       allow_empty_catalog=allow_empty_catalog)

    def check_policy(self, ref: Reference | Digest | str, manifest: Manifest, *,
                     require_signed_by: Sequence[str] = (), require_verified: bool = False,
                     model: ModelIdentity | None = None, for_verification: bool = False,
                     action: str = "load") -> None:
        """Refuse the artifact of `manifest` (named by `ref`) unless the policy accepts it:
        `require_signed_by` (keyids or key names, any one) and `require_verified` add to
        the [policy] table of config.toml. A verification must be for `model` (the live
        model) when given, else for the graft's own model. `for_verification` marks the
        fidelity check itself: it is what produces a verification, so require_verified
        does not apply to it (a signature requirement still does). A refusal is
        PolicyRefused (exit 4), recorded as an `action` event with outcome "refused"."""
        from kvgraft.configfile import load_document

        if not require_signed_by and not require_verified and \
                not load_document(self.config.home).get("policy"):
            return  # nothing to enforce: the signature machinery need not even load
        from kvgraft.provenance import PolicyRefused, load_policy
        from kvgraft.provenance import require_signed_by as signed_check
        from kvgraft.provenance import require_verified as verified_check

        reference = _as_reference(ref)
        digest = manifest.digest
        policy = load_policy(self.config.home, self.keyring)
        keyids = (tuple(self.keyring.resolve(k) for k in require_signed_by)
                  or policy.require_signed_by)
        wanted = (require_verified or policy.require_verified) and not for_verification
        identity = (model or manifest.model) if wanted else None
        if not keyids and identity is None:
            return
        what = str(reference) if reference is not None else str(digest)
        if self.config.offline:
            raise PolicyRefused(f"cannot check the signing/verification policy for "
                                f"{what} offline (it needs the catalog)")
        try:
            if keyids:
                signed_check(self.catalog, digest, keyids, self.keyring.trusted())
            if identity is not None:
                verified_check(self.catalog, digest, identity)
        except PolicyRefused as e:
            self.catalog.add_event(self._event(
                action, repository=reference.name if reference else None,
                tag=reference.tag if reference else None, digest=digest, outcome="refused",
                detail={"reason": e.message}))
            raise

    def _ensure_blobs(self, manifest: Manifest,
                      reupload: Callable[[], Iterable[BlobRecord]]) -> None:
        from kvgraft.transfer.gc import ensure_blobs

        if self.http is not None:
            return  # the server checks its own gc history when it commits the push
        ensure_blobs(self.catalog, self.store, manifest, reupload)


def _as_reference(ref: Reference | Digest | str) -> Reference | None:
    if isinstance(ref, Digest):
        return None
    return Reference.parse(ref) if isinstance(ref, str) else ref

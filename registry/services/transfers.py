"""Moving artifacts: push, the one open-for-use path (`open`, which every pull and every
load takes, so the policy holds on all of them), pull and copy between registries."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvgraft.catalog.records import BlobRecord, PushOutcome, PushRecord
from kvgraft.digest import Digest
from kvgraft.errors import NotFound, RegistryError, UsageError
from kvgraft.identity.model import ModelIdentity
from kvgraft.reference import Reference
from kvgraft.services.policy import as_reference

if TYPE_CHECKING:
    from kvgraft.formats.manifest import Manifest
    from kvgraft.services.backends import Backends
    from kvgraft.services.events import EventLog
    from kvgraft.services.manifests import Manifests
    from kvgraft.services.policy import Policy
    from kvgraft.transfer.copy import CopyStats
    from kvgraft.transfer.pull import Fetcher, FetchStats, Progress
    from kvgraft.transfer.push import PushOptions

_LABEL_KEY_MAX = 255


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
    evicted: tuple[Digest, ...] = ()  # what the repository's quota evicted to make room


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


def best_effort(what: str, fn: Callable[[], object]) -> tuple[str, ...]:
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


def _parsed(ref: Reference | str) -> Reference:
    return Reference.parse(ref) if isinstance(ref, str) else ref


class Transfers:
    def __init__(self, backends: Backends, manifests: Manifests, policy: Policy,
                 events: EventLog) -> None:
        self.backends = backends
        self.manifests = manifests
        self.policy = policy
        self.events = events

    def commit(self, push: PushRecord, reupload: Callable[[], Iterable[BlobRecord]],
               ) -> PushOutcome:
        """Commit a push whose blobs are stored, then make sure no concurrent gc took one
        of them (`reupload` stores them again)."""
        outcome = self.backends.catalog.record_push(push)
        self.backends.ensure_blobs(push.manifest, reupload)
        return outcome

    def push(self, path: str | Path, ref: Reference | str, *,
             labels: Mapping[str, str] | None = None, options: PushOptions | None = None,
             progress: Progress | None = None) -> PushResult:
        from kvgraft.transfer.push import PushOptions, build_artifact

        ref = _parsed(ref)
        if ref.digest is not None:
            raise UsageError(f"push takes name[:tag], not a digest: {ref}")
        labels = check_labels(labels or {})
        options = options or PushOptions()
        catalog = self.backends.catalog
        for parent in options.parents:
            if not catalog.has_artifact(parent):
                raise NotFound(f"parent artifact {parent} is not in the catalog")
        store = self.backends.blobs(ref.name)
        upload = build_artifact(path, store, options, progress)
        m = upload.manifest
        event = self.events.event("push", repository=ref.name, tag=ref.tag, digest=m.digest,
                                  detail={"blobs_stored": upload.stored,
                                          "bytes_stored": upload.stored_bytes})
        outcome = catalog.record_push(PushRecord(m, upload.blobs, ref.name, ref.tag, labels,
                                                 event))
        if upload.repaired:  # the rows may describe the corrupt objects' encoding
            catalog.refresh_blobs(upload.repaired)
        self.backends.ensure_blobs(m, lambda: build_artifact(path, store, options).blobs)
        # The push is committed: remembering it in this machine's cache is a convenience
        # (for --offline), so a full or broken cache is a warning, not a failed push.
        cache = self.backends.cache

        def remember() -> None:
            cache.put_manifest(m.digest, m.canonical())
            cache.put_ref(ref, m.digest)

        warnings = best_effort(f"caching {ref}", remember)
        return PushResult(m.digest, ref, outcome.created, upload.stored, upload.stored_bytes,
                          m.size, sum(b.stored_size for b in upload.blobs), m.token_count,
                          outcome.previous, warnings, outcome.evicted)

    def open(self, ref: Reference | Digest | str, *, require_signed_by: Sequence[str] = (),
             require_verified: bool = False, model: ModelIdentity | None = None,
             for_verification: bool = False, action: str = "load") -> OpenedArtifact:
        """The one way to open an artifact for use: resolve `ref`, read its manifest,
        enforce the policy (`Policy.check`), and hand back a fetcher reading its blobs
        through the machine cache. Every path that hands KV onward goes through here."""
        from kvgraft.transfer.pull import Fetcher

        reference = as_reference(ref)
        digest = ref if isinstance(ref, Digest) else self.backends.resolve(_parsed(ref))
        manifest = self.manifests.get(digest)
        self.policy.check(reference or digest, manifest, require_signed_by=require_signed_by,
                          require_verified=require_verified, model=model,
                          for_verification=for_verification, action=action)
        store = self.backends.fetch_store(reference.name if reference else None, digest)
        return OpenedArtifact(reference, digest, manifest, Fetcher(store, self.backends.cache))

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

        ref = _parsed(ref)
        opened = self.open(ref, require_signed_by=require_signed_by,
                           require_verified=bool(require_verified),
                           model=require_verified if isinstance(require_verified, ModelIdentity)
                           else None, action="pull")
        digest, manifest = opened.digest, opened.manifest
        if output is None:
            stats = fetch(manifest, opened.fetcher, workers=workers, progress=progress)
        else:
            stats = export(manifest, opened.fetcher, output, workers=workers, progress=progress)
        warnings = best_effort(f"remembering {ref} in the cache",
                               lambda: self.backends.cache.put_ref(ref, digest))
        self.events.record("pull", repository=ref.name, tag=ref.tag, digest=digest,
                           detail={"fetched": stats.fetched, "fetched_bytes": stats.fetched_bytes,
                                   "output": str(output) if output else None})
        return PullResult(digest, ref, output, stats, warnings)

    def copy(self, src: Reference | str, target: Transfers, dst: Reference | str,
             ) -> tuple[Digest, CopyStats]:
        """Copy the artifact `src` names into `target`'s registry as `dst`; only missing
        blobs move. Labels come along; the copy is an event in both catalogs."""
        from kvgraft.transfer.copy import copy_blobs

        src, dst = _parsed(src), _parsed(dst)
        digest = self.backends.resolve(src)
        if dst.digest is not None and dst.digest != digest:
            raise UsageError(f"{dst} names a different digest than {src}")
        manifest = self.manifests.from_catalog(digest)
        src_store, dst_store = self.backends.blobs(src.name), target.backends.blobs(dst.name)
        stats = copy_blobs(manifest, src_store, dst_store)
        labels = self.backends.catalog.artifact(digest, src.name).labels
        detail = {"source": f"{self.backends.config.remote or 'local'}:{src}",
                  "target": f"{target.backends.config.remote or 'local'}:{dst}",
                  "blobs_copied": stats.copied, "bytes_copied": stats.copied_bytes}
        target.commit(PushRecord(manifest, stats.blobs, dst.name, dst.tag, labels,
                                 target.events.event("copy", repository=dst.name, tag=dst.tag,
                                                     digest=digest, detail=detail)),
                      lambda: copy_blobs(manifest, src_store, dst_store).blobs)
        self.events.record("copy", repository=src.name, tag=src.tag, digest=digest,
                           detail=detail)
        return digest, stats

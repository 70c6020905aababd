"""The per-machine pull cache under $KVGRAFT_CACHE: verified blobs (as the store holds
them, so filling the cache costs no re-encoding and no more disk than the compressed
size), manifests and the references last resolved (so `pull --offline` needs neither
catalog nor store).

Entries are written by unique temp file + link/rename and re-verified on every read, so a
torn or tampered entry is dropped and fetched again. Locks only save duplicate downloads
when several processes pull the same blob at once; correctness never depends on them
(flock may do nothing on network filesystems).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast
from urllib.parse import quote, unquote

from kvgraft.blobstore.base import blob_path
from kvgraft.blobstore.local import LocalBlobStore
from kvgraft.codecs.codec import RawCodec, decode_blob, frame, frame_header, max_stored_size
from kvgraft.digest import Buffer, Digest
from kvgraft.errors import IntegrityError, UsageError
from kvgraft.formats.manifest import Manifest
from kvgraft.fsutil import STALE_TEMP, MiB, atomic_writer, read_bounded, sweep_temp
from kvgraft.reference import Reference

MAX_MANIFEST = 64 * MiB  # a manifest of ~200 000 chunks; larger is damage, not data
MAX_REF = 4096  # a digest and a newline
REFS = "tags"  # the reference layout (see _ref_path)
# Fetch locks are shared by the blobs whose digests start with the same three hex digits:
# at most 4096 lock files, where one per blob left an empty file behind for every blob
# ever fetched (and cost an inode's allocation per fetch). Two fetches that share a lock
# only wait for each other, and with a few in flight they rarely do.
LOCK_STRIPE_HEX = 3
_OLD_LOCK = re.compile(r"[0-9a-f]{64}\.lock")  # one blob's lock file, as locks were


@dataclass(frozen=True, slots=True)
class CachedArtifact:
    digest: Digest
    refs: tuple[str, ...]
    size: int  # decoded bytes the artifact needs
    cached_bytes: int  # of those, how many are in the cache
    last_used: float

    @property
    def complete(self) -> bool:
        return self.cached_bytes == self.size


@dataclass(frozen=True, slots=True)
class PruneReport:
    artifacts: int
    blobs: int
    bytes_freed: int


class Cache:
    def __init__(self, root: Path) -> None:
        self.root = root.absolute()
        self.blobs = LocalBlobStore(self.root / "blobs", durable=False)
        self._raw = RawCodec()

    # --- blobs -------------------------------------------------------------------------

    def get(self, digest: Digest, size: int, into: Buffer | None = None, *,
            keep_decoded: bool = False) -> Buffer | None:
        """The verified decoded blob (decoded into `into` if given), or None (a bad entry
        is removed). With `keep_decoded` a compressed entry, once verified, is replaced by
        its decoded bytes: later reads then only hash them (decoding cost more than the
        hash), for 1.3x the disk."""
        if into is not None:
            found = self._get_raw_into(digest, size, into)
            if found is not None:
                return found
        try:
            stored = self.blobs.get(digest, max_stored_size(size))
        except LookupError:
            return None
        except IntegrityError:  # oversized or not a plain file: drop it, fetch again
            self.blobs.delete(digest)
            return None
        try:
            codec, data = decode_blob(stored, size, into)
            digest.check(Digest.of(data), f"cached blob {digest}")
        except IntegrityError:
            self.blobs.delete(digest)
            return None
        if keep_decoded and codec != self._raw.name:
            self.blobs.replace(digest, frame(self._raw, data))
        return data

    def _get_raw_into(self, digest: Digest, size: int, into: Buffer) -> Buffer | None:
        """An uncompressed entry read straight into `into` and verified; None when the entry
        is missing or not uncompressed (the caller reads it the general way)."""
        try:
            f = self.blobs.open(digest)
        except (LookupError, IntegrityError):
            return None
        with f:
            header = frame_header(self._raw.name, size)
            if f.read(len(header)) != header:
                return None
            view = memoryview(into).cast("B")[:size]
            if view.nbytes != size:
                raise ValueError(f"decode buffer holds {view.nbytes} bytes, {size} needed")
            if cast(io.BufferedReader, f).readinto(view) != size or f.read(1):
                self.blobs.delete(digest)  # truncated or grown: fetch again
                return None
        try:
            digest.check(Digest.of(view), f"cached blob {digest}")
        except IntegrityError:
            self.blobs.delete(digest)
            return None
        return view

    def put(self, digest: Digest, data: Buffer) -> None:
        """Cache verified decoded bytes (stored uncompressed), replacing a bad entry."""
        parts = frame(self._raw, data)
        if not self.blobs.put(digest, parts) and not self.blobs.exists(digest):
            self.blobs.replace(digest, parts)

    def put_stored(self, digest: Digest, stored: Buffer) -> None:
        """Cache a stored blob exactly as fetched; the caller has verified it. A bad entry in
        the way (a symlink to a device, say, which `has` does not count) is replaced."""
        if not self.blobs.put(digest, [stored]) and not self.blobs.exists(digest):
            self.blobs.replace(digest, [stored])

    def has(self, digest: Digest) -> bool:
        return self.blobs.exists(digest)

    @contextlib.contextmanager
    def lock(self, digest: Digest) -> Iterator[None]:
        """Serialise fetches of one blob across local processes (an optimisation only)."""
        path = self.root / "locks" / f"{digest.hex[:LOCK_STRIPE_HEX]}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # --- manifests and references ------------------------------------------------------

    def _manifest_path(self, digest: Digest) -> Path:
        return self.root / "manifests" / blob_path(digest)

    def put_manifest(self, digest: Digest, raw: bytes) -> None:
        path = self._manifest_path(digest)
        if not path.is_file():
            with atomic_writer(path, durable=False) as f:
                f.write(raw)

    def get_manifest(self, digest: Digest) -> bytes | None:
        path = self._manifest_path(digest)
        try:
            raw = read_bounded(path, MAX_MANIFEST, "cached manifest", IntegrityError)
        except FileNotFoundError:
            return None
        except IntegrityError:
            raw = b""  # not a plain file or far too large: drop it like a wrong one
        if Digest.of(raw) != digest:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # last use, for prune --older-than
        return raw

    def _ref_path(self, ref: Reference) -> Path:
        # One flat file per reference, `<name with / escaped>@<tag>`: neither '%' nor '@'
        # can occur in a name or a tag, so no two references share a path or nest inside
        # each other (`refs/<name>/<tag>`, the old layout, made `a:b` a file where `a/b:c`
        # needed a directory; that tree is ignored and removed by prune).
        if ref.tag is None:
            raise UsageError("only tag references are remembered")
        return self.root / REFS / f"{quote(ref.name, safe='')}@{ref.tag}"

    def put_ref(self, ref: Reference, digest: Digest) -> None:
        if ref.tag is None:
            return
        with atomic_writer(self._ref_path(ref), durable=False) as f:
            f.write(str(digest).encode())

    def get_ref(self, ref: Reference) -> Digest | None:
        if ref.digest is not None:
            return ref.digest
        try:
            raw = read_bounded(self._ref_path(ref), MAX_REF, "cached reference")
            return Digest.parse(raw.decode("ascii", "replace").strip())
        except (FileNotFoundError, UsageError):
            return None

    def _refs(self) -> dict[Digest, list[str]]:
        out: dict[Digest, list[str]] = {}
        base = self.root / REFS
        if base.is_dir():
            for path in sorted(base.iterdir()):
                name, at, tag = path.name.rpartition("@")
                if path.name.startswith(".") or not at:
                    continue
                with contextlib.suppress(UsageError, OSError):
                    raw = read_bounded(path, MAX_REF, "cached reference")
                    digest = Digest.parse(raw.decode("ascii", "replace").strip())
                    out.setdefault(digest, []).append(f"{unquote(name)}:{tag}")
        return out

    # --- listing and pruning -----------------------------------------------------------

    def _manifests(self) -> Iterator[tuple[Manifest, float]]:
        base = self.root / "manifests" / "sha256"
        if not base.is_dir():
            return
        for path in sorted(base.glob("*/*")):
            if path.name.startswith("."):
                continue
            with contextlib.suppress(UsageError, IntegrityError, OSError):
                digest = Digest(path.parent.name + path.name)
                raw = read_bounded(path, MAX_MANIFEST, "cached manifest", IntegrityError)
                yield Manifest.parse(raw, digest), path.stat().st_mtime

    def artifacts(self) -> list[CachedArtifact]:
        refs = self._refs()
        out = []
        for m, mtime in self._manifests():
            blobs = m.blobs()
            cached = sum(b.size for b in blobs if self.has(b.digest))
            out.append(CachedArtifact(m.digest, tuple(refs.get(m.digest, ())),
                                      sum(b.size for b in blobs), cached, mtime))
        return out

    def prune(self, *, older_than: float | None = None, everything: bool = False,
              dry_run: bool = False) -> PruneReport:
        """Forget artifacts unused for `older_than` seconds (all with `everything`), then
        delete blobs no remaining cached manifest needs, and stale temp files."""
        now = time.time()
        keep: set[Digest] = set()
        dropped = 0
        refs = self._refs()
        for m, mtime in self._manifests():
            if everything or (older_than is not None and now - mtime >= older_than):
                dropped += 1
                if not dry_run:
                    for ref in refs.get(m.digest, ()):
                        with contextlib.suppress(FileNotFoundError, UsageError):
                            os.unlink(self._ref_path(Reference.parse(ref)))
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._manifest_path(m.digest))
            else:
                keep.update(b.digest for b in m.blobs())
        blobs = freed = 0
        for info in list(self.blobs.iter()):
            if info.digest not in keep:
                blobs += 1
                freed += info.stored_size
                if not dry_run:
                    self.blobs.delete(info.digest)
        if not dry_run:
            self._sweep_temp(now)
            shutil.rmtree(self.root / "refs", ignore_errors=True)  # the old ref layout
            self._remove_old_locks()
        return PruneReport(dropped, blobs, freed)

    def _remove_old_locks(self) -> None:
        """Lock files of single blobs, as earlier versions left them (one per blob fetched).
        A process still holding one only loses its saving of a duplicate download."""
        # Housekeeping only: what cannot be read or removed stays, and the prune goes on.
        with contextlib.suppress(OSError), os.scandir(self.root / "locks") as it:
            for entry in it:
                if _OLD_LOCK.fullmatch(entry.name):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)

    def _sweep_temp(self, now: float, grace: float = STALE_TEMP) -> None:
        sweep_temp(self.root, recursive=True, older_than=grace)

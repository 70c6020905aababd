"""`kvgraft doctor`: whether the environment kvgraft runs in works, and what to fix.

Each check answers ok, problem (with the fix) or skipped (not used here), and none raises:
whatever fails is a finding. Checked: every installed extra imports (kvgraft.services.
extras), the catalog answers and its schema is at this kvgraft's head, the store can be
written, read and cleaned (a probe that leaves nothing behind), the machine cache has room,
and, with a server remote, that the server answers and what the token may do. With a server
remote the catalog and store are the server's: they are not reached directly.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvgraft.config import Config
from kvgraft.digest import Digest
from kvgraft.errors import RegistryError
from kvgraft.services.extras import check_extras

Status = Literal["ok", "problem", "skipped"]
MIN_CACHE_FREE = 1 << 30  # a graft of a long prompt is hundreds of MB


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail,
                "fix": self.fix}


@dataclass(frozen=True, slots=True)
class DoctorReport:
    checks: tuple[Check, ...]

    @property
    def problems(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.status == "problem")

    def to_json(self) -> dict[str, Any]:
        return {"ok": not self.problems, "checks": [c.to_json() for c in self.checks],
                "problems": [c.to_json() for c in self.problems]}


def examine(config: Config, *, extras: bool = True) -> DoctorReport:
    """Every check (`extras`: with the imports of the extras, the slow part)."""
    checks = _extras(config) if extras else []
    served = config.server_url is not None
    for name, probe in (("catalog", _catalog), ("store", _store)):
        if served:
            checks.append(Check(name, "skipped", f"the server's: reached through "
                                f"{config.server_url}"))
        elif config.offline:
            checks.append(Check(name, "skipped", "offline"))
        else:
            checks.append(_guarded(name, probe, config))
    checks.append(_guarded("cache", _cache, config))
    if served and not config.offline:
        checks.append(_guarded("server", _server, config))
    return DoctorReport(tuple(checks))


def _guarded(name: str, probe: Callable[[Config], Check], config: Config) -> Check:
    """The probe's finding; any failure it did not foresee is one too, never a traceback."""
    try:
        return probe(config)
    except RegistryError as e:
        return Check(name, "problem", e.human())
    except Exception as e:
        return Check(name, "problem", f"{type(e).__name__}: {e}")


def _extras(config: Config) -> list[Check]:
    needed = set()
    if not config.server_url and config.blob_url.startswith("s3://"):
        needed.add("s3")
    if not config.server_url and config.catalog_url.startswith("postgresql"):
        needed.add("postgres")
    out = []
    for state in check_extras():
        name = f"extra [{state.extra}]"
        if not state.installed:
            out.append(Check(name, "problem" if state.extra in needed else "skipped",
                             "not installed" + (" (the configuration needs it)"
                                                if state.extra in needed else ""),
                             f"pip install 'kvgraft[{state.extra}]'"))
        elif state.error:
            out.append(Check(name, "problem", state.error, state.fix))
        else:
            out.append(Check(name, "ok", "imports"))
    return out


def _catalog(config: Config) -> Check:
    from sqlalchemy.engine import make_url

    from kvgraft.catalog import schema
    from kvgraft.catalog.engine import make_engine, safe_url
    from kvgraft.catalog.reader import CatalogReader

    url = config.catalog_url
    where = safe_url(url)
    if url.startswith("sqlite"):
        database = make_url(url).database
        if database and not database.startswith("file:") and database != ":memory:" \
                and not Path(database).exists():
            if config.embedded:
                return Check("catalog", "ok", f"{where}: created on first use")
            return Check("catalog", "problem", f"{where}: the file does not exist",
                         "kvgraft db upgrade creates it (or point KVGRAFT_CATALOG_URL at the "
                         "right file)")
    reader = CatalogReader(make_engine(url), url)
    try:
        current = reader.current_revision()
    finally:
        reader.close()
    head = schema.head_revision()
    if current == head:
        return Check("catalog", "ok", f"{where}: reachable, schema at head {head}")
    if current is not None and current not in schema.known_revisions():
        return Check("catalog", "problem", f"{where}: schema at {current}, newer than this "
                     f"kvgraft (head {head})", "upgrade kvgraft")
    if config.embedded:
        return Check("catalog", "ok", f"{where}: schema at {current or 'none'}, upgraded to "
                     f"{head} on next use")
    return Check("catalog", "problem", f"{where}: schema at {current or 'none'}, this "
                 f"kvgraft needs {head}", "kvgraft db upgrade")


def _store(config: Config) -> Check:
    from kvgraft.blobstore import open_store
    from kvgraft.blobstore.local import LocalBlobStore

    store = open_store(config.blob_url)
    if isinstance(store, LocalBlobStore):
        return _local_store(store.root, config.blob_url)
    body = f"kvgraft doctor probe {uuid.uuid4().hex}".encode()
    digest = Digest.of(body)
    store.put(digest, [body])
    try:
        same = store.get(digest) == body
    finally:
        removed = store.delete(digest) or not store.exists(digest)
    if not same:
        return Check("store", "problem", f"{config.blob_url}: a probe blob read back "
                     "different bytes")
    if not removed:
        return Check("store", "problem", f"{config.blob_url}: a probe blob could not be "
                     f"deleted ({digest}): gc will fail too", "grant delete permission")
    return Check("store", "ok", f"{config.blob_url}: writable, readable, probe removed")


def _local_store(root: Path, url: str) -> Check:
    """A file written, read back and removed in the store's directory (its fan-out
    directories are left alone: a probe blob would leave one behind)."""
    if not root.exists():
        parent = _existing_ancestor(root)
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            return Check("store", "problem", f"{url}: does not exist and {parent} is not "
                         "writable", f"create {root} writable by this user")
        return Check("store", "ok", f"{url}: created on first push ({parent} is writable)")
    if not root.is_dir():
        return Check("store", "problem", f"{url}: {root} is not a directory",
                     "point KVGRAFT_BLOB_URL at a directory")
    probe = root / f".kvgraft-doctor-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"probe")
        ok = probe.read_bytes() == b"probe"
    except OSError as e:
        return Check("store", "problem", f"{url}: cannot write in {root}: "
                     f"{e.strerror or e}", f"make {root} writable by this user")
    finally:
        probe.unlink(missing_ok=True)
    if not ok:
        return Check("store", "problem", f"{url}: a probe file read back different bytes")
    return Check("store", "ok", f"{url}: writable, readable, probe removed")


def _cache(config: Config) -> Check:
    path = config.cache_dir
    existing = _existing_ancestor(path)
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return Check("cache", "problem", f"{path}: {existing} is not writable",
                     "set KVGRAFT_CACHE to a writable directory")
    free = shutil.disk_usage(existing).free
    detail = f"{path}: {free / (1 << 30):.1f} GiB free"
    if free < MIN_CACHE_FREE:
        return Check("cache", "problem", detail, "free space there, `kvgraft cache prune "
                     "--older-than 7d`, or set KVGRAFT_CACHE elsewhere")
    return Check("cache", "ok", detail)


def _server(config: Config) -> Check:
    from kvgraft.remote.http import HttpRemote

    url = config.server_url
    assert url is not None
    if config.token_file is None:
        return Check("server", "problem", f"{url}: remote {config.remote!r} names no token "
                     "file", "kvgraft remote add NAME URL --token-file F")
    remote = HttpRemote.with_token_file(url, config.token_file)
    try:
        me = remote.send("GET", "/kvgraft/v1/token", what="the token's scopes")
    finally:
        remote.close()
    scopes = " ".join(str(s) for s in me.get("scopes", [])) or "none"
    return Check("server", "ok", f"{url}: token {me.get('name')!r} ({me.get('state')}), "
                 f"scopes {scopes}")


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path

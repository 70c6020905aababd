"""Named remotes in $KVGRAFT_HOME/config.toml: a catalog URL, a blob store URL and
optionally a cache directory, so one machine can work with several registries.

    [remotes.team]
    catalog = "postgresql+psycopg://kvgraft@db.internal/kvgraft"
    store = "s3://team-grafts/kv"
    cache = "/var/cache/kvgraft-team"
"""

from __future__ import annotations

import io
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgraft.errors import Conflict, NotFound, UsageError
from kvgraft.fsutil import MiB, atomic_writer, read_bounded

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
MAX_CONFIG = MiB  # a config.toml naming remotes; larger is not one


@dataclass(frozen=True, slots=True)
class Remote:
    name: str
    catalog_url: str
    blob_url: str
    cache_dir: Path | None = None
    # An HTTP remote: a `kvgraft serve` URL and the file holding its token, instead of
    # a catalog and a store.
    url: str | None = None
    token_file: Path | None = None

    def __post_init__(self) -> None:
        if not NAME_RE.fullmatch(self.name):
            raise UsageError(f"invalid remote name {self.name!r}",
                             hint="lowercase letters, digits, '.', '_' and '-'")
        if self.url is not None:
            if not re.fullmatch(r"https?://[^\s/]+", self.url.rstrip("/")):
                raise UsageError(f"remote {self.name!r}: not a server URL: {self.url!r}",
                                 hint="e.g. https://registry.internal:5000")
            if self.token_file is None or self.catalog_url or self.blob_url:
                raise UsageError(f"an HTTP remote takes a --token-file and no catalog or "
                                 f"store ({self.name!r})")
        elif not self.catalog_url or not self.blob_url:
            raise UsageError(f"remote {self.name!r} needs both a catalog and a store URL",
                             hint="or a server URL and --token-file")


def config_path(home: Path) -> Path:
    return home / "config.toml"


def load_document(home: Path) -> dict[str, Any]:
    path = config_path(home)
    try:
        return tomllib.load(io.BytesIO(read_bounded(path, MAX_CONFIG, "config file")))
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not valid TOML: it is not UTF-8 text") from None
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory, not a TOML file") from None


def load_remotes(home: Path) -> dict[str, Remote]:
    raw = load_document(home).get("remotes", {})
    if not isinstance(raw, dict):
        raise UsageError(f"{config_path(home)}: [remotes] must be a table")
    out = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict):
            raise UsageError(f"{config_path(home)}: remotes.{name} must be a table")
        unknown = set(spec) - {"catalog", "store", "cache", "url", "token_file"}
        if unknown:
            raise UsageError(f"{config_path(home)}: remotes.{name} has unknown keys "
                             f"{sorted(unknown)}",
                             hint="allowed: catalog, store, cache, url, token_file")
        cache, token_file = spec.get("cache"), spec.get("token_file")
        out[name] = Remote(name, str(spec.get("catalog", "")), str(spec.get("store", "")),
                           Path(cache).expanduser() if cache else None,
                           str(spec["url"]) if spec.get("url") else None,
                           Path(token_file).expanduser() if token_file else None)
    return out


def get_remote(home: Path, name: str) -> Remote:
    remotes = load_remotes(home)
    if name not in remotes:
        known = ", ".join(sorted(remotes)) or "none"
        raise NotFound(f"no remote named {name!r} (configured: {known})",
                       hint="add one with `kvgraft remote add`")
    return remotes[name]


def add_remote(home: Path, remote: Remote, *, replace: bool = False) -> None:
    doc = load_document(home)
    remotes = doc.setdefault("remotes", {})
    if remote.name in remotes and not replace:
        raise Conflict(f"remote {remote.name!r} already exists", hint="use --replace")
    spec: dict[str, str] = {"catalog": remote.catalog_url, "store": remote.blob_url}
    if remote.url is not None and remote.token_file is not None:
        spec = {"url": remote.url, "token_file": str(remote.token_file.absolute())}
    if remote.cache_dir is not None:
        spec["cache"] = str(remote.cache_dir)
    remotes[remote.name] = spec
    _save(home, doc)


def remove_remote(home: Path, name: str) -> None:
    doc = load_document(home)
    if name not in doc.get("remotes", {}):
        raise NotFound(f"no remote named {name!r}")
    del doc["remotes"][name]
    _save(home, doc)


def _save(home: Path, doc: dict[str, Any]) -> None:
    with atomic_writer(config_path(home)) as f:
        f.write(dumps_toml(doc).encode())


def dumps_toml(doc: dict[str, Any], prefix: str = "") -> str:
    """TOML for nested tables of strings, numbers and booleans (all the config holds)."""
    scalars, tables = [], []
    for key, value in doc.items():
        k = key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)
        if isinstance(value, dict):
            tables.append((f"{prefix}{k}", value))
        elif isinstance(value, bool):
            scalars.append(f"{k} = {'true' if value else 'false'}")
        elif isinstance(value, int | float):
            scalars.append(f"{k} = {value}")
        elif isinstance(value, str):
            scalars.append(f"{k} = {json.dumps(value)}")  # JSON strings are TOML strings
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            scalars.append(f"{k} = [{', '.join(json.dumps(v) for v in value)}]")
        else:
            raise TypeError(f"cannot write {type(value).__name__} to TOML")
    out = "\n".join(scalars) + ("\n" if scalars else "")
    for name, table in tables:
        body = dumps_toml(table, f"{name}.")
        out += f"\n[{name}]\n{body}" if any(not isinstance(v, dict) for v in table.values()) \
            else body
    return out

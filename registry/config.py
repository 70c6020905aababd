"""Configuration, read once at the edge into a frozen value (no import-time side effects)."""

from __future__ import annotations

import getpass
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote


@dataclass(frozen=True, slots=True)
class Config:
    home: Path
    catalog_url: str
    blob_url: str
    cache_dir: Path
    offline: bool = False

    @property
    def embedded(self) -> bool:
        """The default SQLite catalog under home, which upgrades itself on first use."""
        return self.catalog_url == default_catalog_url(self.home)

    remote: str | None = None
    server_url: str | None = None  # an HTTP remote (`kvgraft serve`) instead of catalog+store
    token_file: Path | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, remote: str | None = None,
                 **overrides: object) -> Config:
        """Flags (`overrides`) win over a named remote, which wins over the environment."""
        env = os.environ if env is None else env
        home = Path(env.get("KVGRAFT_HOME") or Path.home() / ".kvgraft").expanduser().absolute()
        values: dict[str, object] = {
            "home": home,
            "catalog_url": env.get("KVGRAFT_CATALOG_URL") or default_catalog_url(home),
            "blob_url": env.get("KVGRAFT_BLOB_URL") or (home / "blobs").absolute().as_uri(),
            "cache_dir": Path(env.get("KVGRAFT_CACHE")
                              or Path.home() / ".cache" / "kvgraft").expanduser().absolute(),
            "offline": env.get("KVGRAFT_OFFLINE", "") not in ("", "0", "false", "no"),
        }
        remote = remote or env.get("KVGRAFT_REMOTE") or None
        if remote:
            from kvgraft.configfile import get_remote

            r = get_remote(home, remote)
            if r.url is not None:
                values.update(server_url=r.url.rstrip("/"), token_file=r.token_file,
                              remote=r.name)
            else:
                values.update(catalog_url=r.catalog_url, blob_url=r.blob_url, remote=r.name)
            if r.cache_dir is not None:
                values["cache_dir"] = r.cache_dir.absolute()
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def default_catalog_url(home: Path) -> str:
    """Built, not formatted: a home holding '%41', '?mode=ro', '#' or '@' must name that
    very directory, not be decoded or read as URL query parameters. Every character but '/'
    is percent-encoded, which SQLAlchemy's URL parser decodes back to the same path (tested);
    quoting here keeps SQLAlchemy out of commands that never open the catalog."""
    path = str((home / "catalog.db").absolute())
    return "sqlite:///" + quote(path, safe="/")


def actor() -> tuple[str, str]:
    """(user, host) recorded on events and provenance."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return user, socket.gethostname()

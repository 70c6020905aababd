"""Starting a server: the settings travel to every uvicorn worker in one environment
variable, and each worker builds its own Registry from them (`app_from_env`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from starlette.applications import Starlette

from kvgraft.blobstore.base import Presigning
from kvgraft.client import Registry
from kvgraft.config import Config
from kvgraft.errors import MissingExtra
from kvgraft.server import protocol
from kvgraft.server.app import create_app
from kvgraft.server.context import server_catalog, server_store
from kvgraft.server.metrics import MULTIPROC_ENV
from kvgraft.server.settings import ServerSettings

ENV = "KVGRAFT_SERVE_SETTINGS"
_log = logging.getLogger("kvgraft.server")
_RESERVED_FDS = 64


def _encode(config: Config, settings: ServerSettings) -> str:
    def plain(d: dict[str, Any]) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}

    return json.dumps({"config": plain(asdict(config)), "settings": plain(asdict(settings))})


def _decode(text: str) -> tuple[Config, ServerSettings]:
    raw = json.loads(text)
    c, s = raw["config"], raw["settings"]
    config = Config(**{**c, "home": Path(c["home"]), "cache_dir": Path(c["cache_dir"]),
                       "token_file": Path(c["token_file"]) if c.get("token_file") else None})
    settings = ServerSettings(**{**s, "upload_dir": Path(s["upload_dir"]),
                                 "public": tuple(s["public"])})
    return config, settings


def app_from_env() -> Starlette:
    """The application a uvicorn worker serves (`--factory`)."""
    config, settings = _decode(os.environ[ENV])
    protocol.configure(protocol.ConnectionLimits.of(settings))
    return create_app(lambda: Registry(config), settings)


def serve(config: Config, settings: ServerSettings, *, host: str, port: int, workers: int,
          certfile: Path | None = None, keyfile: Path | None = None,
          forwarded_allow_ips: str | None = None, log_level: str = "info") -> None:
    try:
        import uvicorn
    except ImportError:
        raise MissingExtra("kvgraft serve", "server") from None
    # Fail here, in one clear line, rather than in every worker: catalog reachable and
    # current, store openable.
    registry = Registry(config)
    try:
        server_catalog(registry)
        store = server_store(registry)
        if settings.redirect_blobs and not isinstance(store, Presigning):
            _log.warning("kvgraft serve: --redirect-blobs: %s cannot presign URLs; blob "
                         "bytes go through the server", config.blob_url)
    finally:
        registry.close()
    settings.upload_dir.mkdir(parents=True, exist_ok=True)
    settings = _fit_descriptors(settings)
    os.environ[ENV] = _encode(config, settings)
    # The protocol bounds each connection (kvgraft.server.protocol): head size and time,
    # body rate, connections per worker. Idle keep-alive connections close after 5 s.
    with _metrics_dir(workers):
        uvicorn.run("kvgraft.server.main:app_from_env", factory=True, host=host, port=port,
                    workers=workers if workers > 1 else None, log_level=log_level,
                    http="kvgraft.server.protocol:GuardedHttpTools",
                    ssl_certfile=str(certfile) if certfile else None,
                    ssl_keyfile=str(keyfile) if keyfile else None,
                    timeout_keep_alive=5, proxy_headers=forwarded_allow_ips is not None,
                    forwarded_allow_ips=forwarded_allow_ips,
                    server_header=False, timeout_graceful_shutdown=10)


@contextlib.contextmanager
def _metrics_dir(workers: int) -> Iterator[None]:
    """Several workers keep their metrics in files of a directory this server alone uses,
    which every scrape sums (kvgraft.server.metrics); one worker keeps them in memory."""
    os.environ.pop(MULTIPROC_ENV, None)
    if workers == 1:
        yield
        return
    path = tempfile.mkdtemp(prefix="kvgraft-metrics-")
    os.environ[MULTIPROC_ENV] = path
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _fit_descriptors(settings: ServerSettings) -> ServerSettings:
    """Room for every connection a worker admits, and as many files again (a request holds
    an upload, a blob, a catalog connection), plus a reserve: the soft descriptor limit is
    raised toward the hard one for that, and the connection limit lowered if it cannot be."""
    import resource

    need = 2 * settings.max_connections + _RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        fit = max((soft - _RESERVED_FDS) // 2, 1)
        _log.warning("kvgraft serve: %d open files allowed: at most %d connections per "
                     "worker (not %d)", soft, fit, settings.max_connections)
        settings = replace(settings, max_connections=fit)
    return settings

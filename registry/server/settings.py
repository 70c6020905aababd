"""What a server is allowed to do, read once at start (flags of `kvgraft serve`)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ServerSettings:
    upload_dir: Path  # open uploads live here; every worker of one server shares it
    public: tuple[str, ...] = ()  # repository patterns anyone may pull without a token
    max_upload_bytes: int = 8 << 30  # a blob's decoded size, and what its upload may take
    max_open_uploads: int = 64  # in all, every worker together
    max_open_uploads_per_token: int = 16  # so one token cannot hold every slot
    max_manifest_bytes: int = 4 * MIB  # what the OCI spec suggests registries accept
    upload_ttl_seconds: float = 3600.0  # an upload nothing was written to for this long goes
    # One connection's bounds (per worker process; see kvgraft.server.protocol).
    header_timeout: float = 10.0  # from connection (or the last response) to a whole head
    body_timeout: float = 20.0  # each such window of a body must bring min_body_rate bytes/s
    min_body_rate: int = 1024
    max_connections: int = 512
    page_size: int = field(default=1000)  # tags/list without `n`
    # Answer stored-blob GETs with a 307 to a presigned store URL (where the store can make
    # one), so blob bytes go from the bucket to the client without passing through here.
    redirect_blobs: bool = False
    redirect_seconds: int = 300  # how long such a URL is good for; a client asks again after
    metrics_public: bool = False  # GET /metrics without a token (else admin on `*`)

    def is_public(self, repository: str) -> bool:
        return any(fnmatch.fnmatchcase(repository, p) for p in self.public)

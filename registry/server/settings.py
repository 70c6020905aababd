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
    max_upload_bytes: int = 8 << 30
    max_open_uploads: int = 64
    max_manifest_bytes: int = 4 * MIB  # what the OCI spec suggests registries accept
    upload_ttl_seconds: float = 24 * 3600.0  # abandoned uploads older than this are removed
    page_size: int = field(default=1000)  # tags/list without `n`
    # Answer stored-blob GETs with a 307 to a presigned store URL (where the store can make
    # one), so blob bytes go from the bucket to the client without passing through here.
    redirect_blobs: bool = False
    redirect_seconds: int = 300  # how long such a URL is good for; a client asks again after

    def is_public(self, repository: str) -> bool:
        return any(fnmatch.fnmatchcase(repository, p) for p in self.public)

"""`kvgraft serve`: the OCI distribution API (v1.1) and a versioned kvgraft API over one
catalog and blob store, behind scoped bearer tokens. Needs the [server] extra."""

from kvgraft.server.settings import ServerSettings

__all__ = ["ServerSettings"]

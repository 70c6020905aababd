"""What an HTTP remote needs beyond pulling, under /kvgraft/v1/: the catalog methods a
Registry calls (kvgraft.remote.catalog) and blob uploads (kvgraft.remote.http.HttpStore).

Every request is authorised per repository and action: pull to read, push to upload,
commit and tag, delete to untag, admin over a repository to pin there, admin over
every repository for the whole event log and for quotas. An artifact the token may
not pull in any repository holding it does not exist for it (404, not 403). Events are
written here, under the token's name and the caller's address, whatever the client says;
blob rows are derived from the store, never taken from the client; an upload becomes
visible only once it decoded and hashed to its digest.

The handlers: kvgraft.server.catalogread and .catalogwrite; what they share:
.endpoint."""

from __future__ import annotations

from starlette.routing import Route

from kvgraft.server.catalogread import (
    artifact_digests,
    attestations,
    blob_info,
    blob_records,
    children,
    event_chain,
    events,
    record,
    tags,
)
from kvgraft.server.catalogwrite import add_attestation, add_event, push, tag, untag, upload
from kvgraft.server.endpoint import endpoint_of
from kvgraft.server.kvapi import PREFIX
from kvgraft.server.lifecycleapi import gc, pin, quotas, set_quota


def routes() -> list[Route]:
    p = PREFIX
    return [
        Route(f"{p}/record/{{digest}}", endpoint_of(record), methods=["GET"]),
        Route(f"{p}/tags", endpoint_of(tags), methods=["GET"]),
        Route(f"{p}/blob-records", endpoint_of(blob_records, body="json"), methods=["POST"]),
        Route(f"{p}/artifact-digests", endpoint_of(artifact_digests), methods=["GET"]),
        Route(f"{p}/events", endpoint_of(events), methods=["GET"]),
        Route(f"{p}/events", endpoint_of(add_event, body="json"), methods=["POST"]),
        Route(f"{p}/attestations/{{digest}}", endpoint_of(attestations), methods=["GET"]),
        Route(f"{p}/attestations", endpoint_of(add_attestation, body="json"), methods=["POST"]),
        Route(f"{p}/children/{{digest}}", endpoint_of(children), methods=["GET"]),
        Route(f"{p}/event-chain", endpoint_of(event_chain), methods=["GET"]),
        Route(f"{p}/blobinfo/{{digest}}", endpoint_of(blob_info), methods=["GET"]),
        Route(f"{p}/upload/{{digest}}", upload, methods=["PUT"]),
        Route(f"{p}/push", endpoint_of(push, body="json"), methods=["POST"]),
        Route(f"{p}/tag", endpoint_of(tag, body="json"), methods=["POST"]),
        Route(f"{p}/untag", endpoint_of(untag, body="json"), methods=["POST"]),
        Route(f"{p}/pin", endpoint_of(pin, body="json"), methods=["POST"]),
        Route(f"{p}/quotas", endpoint_of(quotas), methods=["GET"]),
        Route(f"{p}/quotas", endpoint_of(set_quota, body="json"), methods=["POST"]),
        Route(f"{p}/gc", endpoint_of(gc, body="json"), methods=["POST"]),
    ]

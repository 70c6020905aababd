"""Grafts as OCI artifacts: the rendering of a graft as one OCI manifest, a client of the
OCI distribution API, and mirroring into and out of OCI registries."""

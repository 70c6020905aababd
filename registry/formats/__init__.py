"""The formats a graft is made of: the KV file, its chunks and prefix keys, the manifest
(docs/format.md specifies each)."""

"""Blob stores: opaque stored blobs keyed by the SHA-256 of their decoded content."""

from __future__ import annotations

from kvgraft.blobstore.base import BlobInfo, BlobStore, blob_path
from kvgraft.blobstore.open import open_store

__all__ = ["BlobInfo", "BlobStore", "blob_path", "open_store"]

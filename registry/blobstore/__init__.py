"""Blob stores: opaque stored blobs keyed by the SHA-256 of their decoded content."""

from __future__ import annotations

from registry.blobstore.base import BlobInfo, BlobStore, blob_path
from registry.blobstore.open import open_store

__all__ = ["BlobInfo", "BlobStore", "blob_path", "open_store"]

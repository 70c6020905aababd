"""Blob codecs and the self-describing stored-blob frame (docs/format.md, "Blob frames")."""

"""Optional integrations with inference engines (each behind its own extra)."""

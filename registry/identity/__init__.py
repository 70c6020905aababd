"""Model identity: the digests that decide whether a graft belongs to a model (the value,
how it is computed from a model directory, and the compatibility report)."""

"""kvgraft: a content-addressed registry for byte-exact KV-cache grafts."""

# A literal, not importlib.metadata: reading the installed metadata costs more than the
# rest of `kvgraft --version`. tests/test_startup.py checks that it equals pyproject's.
__version__ = "0.1.0"

__all__ = ["__version__"]

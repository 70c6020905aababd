"""The one error hierarchy of kvgraft; each class carries a stable process exit code.

The CLI maps these to exit codes and prints `message` (plus `hint`) on one line; the
library raises nothing else on purpose.
"""

from __future__ import annotations


class RegistryError(Exception):
    """Base of every error kvgraft raises on purpose."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def human(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def __str__(self) -> str:
        return self.human()


class UsageError(RegistryError, ValueError):
    """The caller asked for something malformed: a bad reference, option or argument."""

    exit_code = 2


class NotFound(RegistryError, LookupError):
    exit_code = 3


class IntegrityError(RegistryError):
    """Bytes that do not match what was promised: digest or size mismatch, corrupt data."""

    exit_code = 4


class InvalidKVFile(IntegrityError):
    """A KV file that is not a well-formed kvgraft KV file."""


class UnknownCodec(IntegrityError):
    """A stored blob names a codec this kvgraft does not know."""


class IncompatibleModel(RegistryError):
    exit_code = 5


class Conflict(RegistryError):
    exit_code = 6


class Unavailable(RegistryError, ConnectionError):
    """A blob store or catalog that cannot be reached or used."""

    exit_code = 7


class CatalogOutdated(Unavailable):
    """The catalog schema is older (or newer) than this kvgraft."""


class AuthRefused(RegistryError, PermissionError):
    """A server refused the credentials (missing, unknown, expired, revoked) or the action
    they were used for."""

    exit_code = 8


class MissingExtra(RegistryError, ImportError):
    """An optional backend whose dependencies are not installed."""

    def __init__(self, what: str, extra: str) -> None:
        super().__init__(
            f"{what} needs the [{extra}] extra", hint=f"pip install 'kvgraft[{extra}]'"
        )

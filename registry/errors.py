"""The one error hierarchy of kvgraft; each class carries a stable process exit code, and
the HTTP status and OCI error code a server answers it with.

The CLI maps these to exit codes and prints `message` (plus `hint`) on one line; the
server answers `http_status` with `{"errors": [{"code": oci_code, ...}]}`; the library
raises nothing else on purpose.
"""

from __future__ import annotations


class RegistryError(Exception):
    """Base of every error kvgraft raises on purpose."""

    exit_code = 1
    http_status = 500
    oci_code = "UNKNOWN"

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
    http_status = 400
    oci_code = "UNSUPPORTED"


class InvalidName(UsageError):
    """A repository name that is not one (OCI distribution's grammar, at most 255 long)."""

    oci_code = "NAME_INVALID"


class NotFound(RegistryError, LookupError):
    exit_code = 3
    http_status = 404
    oci_code = "NAME_UNKNOWN"  # a route about blobs or manifests names its own


class IntegrityError(RegistryError):
    """Bytes that do not match what was promised: digest or size mismatch, corrupt data."""

    exit_code = 4
    http_status = 400
    oci_code = "DIGEST_INVALID"


class InvalidKVFile(IntegrityError):
    """A KV file that is not a well-formed kvgraft KV file."""


class UnknownCodec(IntegrityError):
    """A stored blob names a codec this kvgraft does not know."""


class IncompatibleModel(RegistryError):
    exit_code = 5


class Conflict(RegistryError):
    exit_code = 6
    http_status = 409
    oci_code = "DENIED"


class QuotaExceeded(Conflict):
    """A push or tag that would take a repository past its byte quota, even after
    evicting every artifact there that may go: nothing of it was committed."""

    oci_code = "QUOTA_EXCEEDED"


class Unavailable(RegistryError, ConnectionError):
    """A blob store or catalog that cannot be reached or used."""

    exit_code = 7
    http_status = 503
    oci_code = "UNAVAILABLE"


class CatalogOutdated(Unavailable):
    """The catalog schema is older (or newer) than this kvgraft."""


class AuthRefused(RegistryError, PermissionError):
    """A server refused the credentials (missing, unknown, expired, revoked) or the action
    they were used for."""

    exit_code = 8
    http_status = 401
    oci_code = "UNAUTHORIZED"


class MissingExtra(RegistryError, ImportError):
    """An optional backend whose dependencies are not installed."""

    def __init__(self, what: str, extra: str) -> None:
        super().__init__(
            f"{what} needs the [{extra}] extra", hint=f"pip install 'kvgraft[{extra}]'"
        )

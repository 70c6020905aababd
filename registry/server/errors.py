"""OCI error responses: `{"errors": [{"code", "message", "detail"}]}` with its status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from kvgraft.errors import (
    AuthRefused,
    Conflict,
    IntegrityError,
    NotFound,
    RegistryError,
    Unavailable,
    UsageError,
)


class OciError(Exception):
    def __init__(self, status: int, code: str, message: str, *, detail: Any = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.detail = detail
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"errors": [{"code": self.code, "message": self.message,
                            "detail": self.detail}]}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def from_registry_error(e: RegistryError, *, unknown: str = "NAME_UNKNOWN") -> OciError:
    """The OCI error for a library error; `unknown` is the code a NotFound gets here."""
    text = e.human()
    if isinstance(e, AuthRefused):
        return OciError(401, "UNAUTHORIZED", text)
    if isinstance(e, NotFound):
        return OciError(404, unknown, text)
    if isinstance(e, UsageError):
        return OciError(400, "NAME_INVALID" if "name" in e.message else "UNSUPPORTED", text)
    if isinstance(e, IntegrityError):
        return OciError(400, "DIGEST_INVALID", text)
    if isinstance(e, Conflict):
        return OciError(409, "DENIED", text)
    if isinstance(e, Unavailable):
        return OciError(503, "UNAVAILABLE", text)
    return OciError(500, "UNKNOWN", text)

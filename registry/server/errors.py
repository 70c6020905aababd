"""OCI error responses: `{"errors": [{"code", "message", "detail"}]}` with its status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from kvgraft.errors import RegistryError


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


def from_registry_error(e: RegistryError) -> OciError:
    """The OCI error for a library error, chosen by its type: the class names its HTTP
    status and OCI code (errors.InvalidName is NAME_INVALID, any other UsageError
    UNSUPPORTED)."""
    return OciError(e.http_status, e.oci_code, e.human())


def digits(text: str, most: int = 18) -> bool:
    """Whether `text` is a whole number int() takes and a 64-bit column holds: ASCII
    digits only (str.isdigit also accepts '²', which int() refuses), at most `most`."""
    return 0 < len(text) <= most and text.isascii() and text.isdigit()

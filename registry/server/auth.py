"""Who is calling and whether they may: bearer tokens, Basic with the token as password,
and the Distribution token flow (`GET /v2/token` hands back the presented token), which is
what docker, oras and skopeo speak. Anonymous callers may pull public repositories only."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from datetime import UTC, datetime

from starlette.requests import Request

from kvgraft.catalog.tokens import TokenTable
from kvgraft.errors import AuthRefused
from kvgraft.server.errors import OciError
from kvgraft.server.settings import ServerSettings
from kvgraft.tokens import Token, secret_hash

ANONYMOUS = "anonymous"  # the token the token endpoint hands out without credentials
SERVICE = "kvgraft"
MAX_CREDENTIAL = 4096


@dataclass(frozen=True, slots=True)
class Principal:
    token: Token | None  # None: anonymous

    @property
    def name(self) -> str:
        return f"token:{self.token.name}" if self.token else ANONYMOUS

    def may(self, settings: ServerSettings, repository: str, action: str) -> bool:
        if self.token is not None:
            return self.token.allows(repository, action)
        return action == "pull" and settings.is_public(repository)


def presented_secret(request: Request) -> str | None:
    """The token in the Authorization header (Bearer, or Basic's password), or None."""
    header = request.headers.get("authorization")
    if not header:
        return None
    if len(header) > MAX_CREDENTIAL:
        raise AuthRefused("the Authorization header is too long")
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value
    if scheme.lower() == "basic":
        try:
            _, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise AuthRefused("malformed Basic credentials") from None
        return password
    raise AuthRefused(f"unsupported authorization scheme {scheme!r}",
                      hint="send Authorization: Bearer <token>")


def authenticate(request: Request, tokens: TokenTable) -> Principal:
    secret = presented_secret(request)
    if secret is None or secret == ANONYMOUS:
        return Principal(None)
    token = tokens.by_hash(secret_hash(secret))
    if token is None:
        raise AuthRefused("unknown token", hint="create one with `kvgraft token create`")
    token.require_usable(datetime.now(UTC))
    return Principal(token)


def challenge(request: Request, scope: str | None) -> dict[str, str]:
    realm = str(request.url_for("token_endpoint"))
    value = f'Bearer realm="{realm}",service="{SERVICE}"'
    if scope:
        value += f',scope="{scope}"'
    return {"WWW-Authenticate": value}


def refuse(request: Request, principal: Principal | None, repository: str | None,
           action: str, message: str | None = None) -> OciError:
    """401 for a caller without (valid) credentials, 403 for one whose token lacks the scope."""
    scope = f"repository:{repository}:{action}" if repository else None
    if principal is None or principal.token is None:
        return OciError(401, "UNAUTHORIZED",
                        message or "authentication required: send a token with the scope "
                        f"{scope or 'to use this registry'}",
                        headers=challenge(request, scope))
    return OciError(403, "DENIED",
                    f"token {principal.token.name!r} has no {action} scope on {repository}",
                    detail={"scope": scope})

"""API tokens of `kvgraft serve`: secrets, scopes and the decision whether one allows an
action on a repository. The catalog keeps only the SHA-256 of a secret (kvgraft.catalog.tokens).

A scope is `repository:<pattern>:<action>[,<action>…]`; a token holds one or more, separated
by spaces. The pattern is matched against the whole repository name with shell rules
(`*` also crosses `/`, so `team/*` covers `team/a/b`). Actions: pull, push, delete, and
admin (everything, plus tokens and gc); `*` is every action.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from kvgraft.errors import AuthRefused, UsageError

ACTIONS = ("pull", "push", "delete", "admin")
PREFIX = "kvg_"
_PATTERN = re.compile(r"[a-z0-9._/*?-]{1,255}")
_DURATION = re.compile(r"(\d+)([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@dataclass(frozen=True, slots=True)
class Scope:
    pattern: str
    actions: frozenset[str]

    @classmethod
    def parse(cls, text: str) -> Scope:
        kind, _, rest = text.partition(":")
        pattern, sep, actions = rest.rpartition(":")
        if kind != "repository" or not sep or not _PATTERN.fullmatch(pattern):
            raise UsageError(f"invalid scope {text!r}",
                             hint="write repository:<pattern>:<actions>, e.g. "
                                  "'repository:team/*:pull,push'")
        names = {a.strip() for a in actions.split(",")}
        if "*" in names:
            names = set(ACTIONS)
        unknown = names - set(ACTIONS)
        if unknown or not names:
            raise UsageError(f"invalid scope {text!r}: unknown action(s) "
                             f"{', '.join(sorted(unknown)) or '(none)'}",
                             hint=f"actions are {', '.join(ACTIONS)} or *")
        return cls(pattern, frozenset(names))

    def allows(self, repository: str, action: str) -> bool:
        if not fnmatch.fnmatchcase(repository, self.pattern):
            return False
        return action in self.actions or "admin" in self.actions

    @property
    def covers_all(self) -> bool:
        """Whether the pattern matches every repository name. Only `*` alone does: a
        pattern that matches the name `*` (`?`, `[*]`) matches one name, not all."""
        return set(self.pattern) == {"*"}

    def __str__(self) -> str:
        return f"repository:{self.pattern}:{','.join(a for a in ACTIONS if a in self.actions)}"


def parse_scopes(texts: Iterable[str]) -> tuple[Scope, ...]:
    scopes = tuple(Scope.parse(part) for text in texts for part in text.split())
    if not scopes:
        raise UsageError("a token needs at least one scope",
                         hint="--scope 'repository:team/*:pull'")
    return scopes


def parse_duration(text: str) -> timedelta:
    """`30d`, `12h`, `90m`, `2w`, `45s`."""
    m = _DURATION.fullmatch(text.strip())
    if not m or int(m.group(1)) == 0:
        raise UsageError(f"invalid duration {text!r}", hint="e.g. 30d, 12h, 90m, 2w")
    return timedelta(seconds=int(m.group(1)) * _UNITS[m.group(2)])


def new_secret() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def secret_hash(secret: str) -> str:
    return "sha256:" + hashlib.sha256(secret.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class Token:
    """A token as the catalog describes it (never its secret)."""

    id: int
    name: str
    scopes: tuple[Scope, ...]
    created_at: datetime
    created_by: str
    expires_at: datetime | None = None
    revoked_at: datetime | None = None

    def state(self, now: datetime) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"

    def allows(self, repository: str, action: str) -> bool:
        return any(s.allows(repository, action) for s in self.scopes)

    @property
    def is_admin(self) -> bool:
        """Admin over the whole registry (the whole event log, every model): a scope
        granting admin on a pattern that covers every repository."""
        return any(s.covers_all and "admin" in s.actions for s in self.scopes)

    def require_usable(self, now: datetime) -> None:
        state = self.state(now)
        if state != "active":
            raise AuthRefused(f"token {self.name!r} is {state}",
                              hint="ask an administrator for a new token")

    def to_json(self, now: datetime) -> dict[str, object]:
        return {"id": self.id, "name": self.name, "scopes": [str(s) for s in self.scopes],
                "created_at": self.created_at.isoformat(), "created_by": self.created_by,
                "expires_at": self.expires_at.isoformat() if self.expires_at else None,
                "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
                "state": self.state(now)}

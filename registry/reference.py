"""References: `name[:tag]` or `name@sha256:<hex>` (docs/format.md §2)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvgraft.digest import Digest
from kvgraft.errors import InvalidName, UsageError

_SEGMENT = r"[a-z0-9]+(?:[._-][a-z0-9]+)*"
NAME_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
MAX_NAME = 255
DEFAULT_TAG = "latest"


def check_name(name: str) -> str:
    if len(name) > MAX_NAME:
        raise InvalidName(f"repository name longer than {MAX_NAME} characters: {name[:40]!r}…")
    if not NAME_RE.fullmatch(name):
        raise InvalidName(
            f"invalid repository name {name!r}",
            hint="use lowercase [a-z0-9] segments joined by '.', '_', '-' and '/'",
        )
    return name


def check_tag(tag: str) -> str:
    if not TAG_RE.fullmatch(tag):
        raise UsageError(
            f"invalid tag {tag!r}", hint="tags match [A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
        )
    return tag


@dataclass(frozen=True, slots=True)
class Reference:
    """A parsed reference; exactly one of `tag` and `digest` is set."""

    name: str
    tag: str | None = None
    digest: Digest | None = None

    def __post_init__(self) -> None:
        check_name(self.name)
        if (self.tag is None) == (self.digest is None):
            raise UsageError("a reference names either a tag or a digest")
        if self.tag is not None:
            check_tag(self.tag)

    @classmethod
    def parse(cls, text: str) -> Reference:
        if not text:
            raise UsageError("empty reference")
        name, at, digest = text.partition("@")
        if at:
            return cls(name, digest=Digest.parse(digest))
        # A ':' after the last '/' separates the tag; names themselves never hold ':'.
        slash = text.rfind("/")
        colon = text.rfind(":")
        if colon > slash:
            return cls(text[:colon], tag=text[colon + 1 :])
        return cls(text, tag=DEFAULT_TAG)

    def __str__(self) -> str:
        return f"{self.name}@{self.digest}" if self.digest else f"{self.name}:{self.tag}"

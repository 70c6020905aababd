"""What every command module shares: the registry of the invocation, the shared options and
the parsers of option values. Imports nothing heavy, so that the command modules (and
`kvgraft --help`) load without the catalog, the store or numpy."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from kvgraft.errors import UsageError

if TYPE_CHECKING:
    from kvgraft.client import Registry

F = TypeVar("F", bound=Callable[..., Any])

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")

_DURATION = re.compile(r"([0-9]{1,12})([smhdw]?)")  # ASCII digits; 12 keep int() cheap
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
MAX_DURATION = 100 * 365 * 86400  # far past any retention, far below datetime's range


class LazyChoice(click.Choice[str]):
    """A Choice whose values are computed when first needed (parsing or help), so that
    defining the command does not import the module that knows them."""

    def __init__(self, load: Callable[[], Sequence[str]]) -> None:
        self._load = load
        self._choices: tuple[str, ...] | None = None
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        if self._choices is None:
            self._choices = tuple(self._load())
        return self._choices

    @choices.setter
    def choices(self, value: Sequence[str]) -> None:
        pass  # Choice.__init__ sets it; the loader is what counts


def current_registry(ctx: click.Context) -> Registry:
    """The Registry the `kvgraft` group opened for this invocation (lazily: nothing is
    connected until a command touches the catalog or the store)."""
    reg: Registry = ctx.find_root().obj
    return reg


def signed_by_option(fn: F) -> F:
    """--require-signed-by: added to the [policy] of config.toml."""
    return click.option("--require-signed-by", "signed_by", multiple=True, metavar="KEYID",
                        help="Refuse unless signed by this trusted key (repeatable: any one "
                             "of them).")(fn)


def policy_options(fn: F) -> F:
    """--require-signed-by / --require-verified: added to the [policy] of config.toml."""
    fn = click.option("--require-verified", is_flag=True,
                      help="Refuse unless a fidelity check on the graft's model passed.")(fn)
    return signed_by_option(fn)


def parse_labels(pairs: tuple[str, ...]) -> dict[str, str]:
    """KEY=VALUE option values → a dict."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise UsageError(f"labels are key=value, got {pair!r}")
        out[key] = value
    return out


def parse_duration(text: str) -> float:
    """'0s', '30s', '15m', '24h', '7d', '2w' → seconds (at most 100 years)."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise UsageError(f"not a duration: {text!r}", hint="use e.g. 30s, 15m, 24h, 7d")
    seconds = int(m.group(1)) * _UNITS[m.group(2)]
    if seconds > MAX_DURATION:
        raise UsageError(f"duration {text!r} is longer than 100 years", hint="use e.g. 7d")
    return seconds


_SIZE = re.compile(r"([0-9]{1,19}(?:\.[0-9]{1,6})?) ?([KMGTP]i?B|[KMGTP]|B)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
               "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
               "tb": 1000**4, "tib": 1024**4, "p": 1000**5, "pb": 1000**5, "pib": 1024**5}
MAX_SIZE = 2**63 - 1


def parse_size(text: str) -> int:
    """'200GiB', '1.5TB', '512MiB', '1000' → bytes (KiB/MiB/GiB: powers of 1024; KB/MB/GB
    and bare K/M/G: of 1000)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise UsageError(f"not a size: {text!r}", hint="use e.g. 200GiB, 1.5TB, 512MiB")
    n = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])
    if n > MAX_SIZE:
        raise UsageError(f"size {text!r} is too large", hint="at most 8 EiB")
    return n

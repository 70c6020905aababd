"""JSON from untrusted bytes, accepted only if kvgraft can hash and store it again.

`json.loads` alone lets through what later breaks far from the input: NaN, Infinity and
1e999999 (canonical JSON refuses them), integers of thousands of digits (int() refuses them),
lone surrogates (not encodable as UTF-8, so not hashable or storable) and nesting deep enough
to raise RecursionError. Every refusal here is a ValueError naming the problem, so callers
turn it into their own typed error with the exit code that fits their input.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 64  # no kvgraft document nests deeper than a handful of levels
MAX_NUMBER_CHARS = 40  # a 64-bit integer or a double fits easily


class RejectedJSON(ValueError):
    """Parsed or not, this JSON is not something kvgraft accepts."""


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise RejectedJSON(f"number with {len(text)} digits")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise RejectedJSON(f"number with {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise RejectedJSON(f"number {text} overflows a double")
    return value


def _constant(name: str) -> Any:
    raise RejectedJSON(f"{name} is not a JSON number")


def loads(raw: bytes | str) -> Any:
    """Parse `raw` (UTF-8 when bytes); RejectedJSON (a ValueError) on anything refused,
    with JSON syntax errors reported the same way."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RejectedJSON:
        raise
    except RecursionError:
        raise RejectedJSON("nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RejectedJSON(str(e)) from None
    check(value)
    return value


def check(value: Any) -> None:
    """Bounded depth and strings that encode as UTF-8, iteratively (no recursion to abuse)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise RejectedJSON(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, str):
            _utf8(item)
        elif isinstance(item, dict):
            for k, v in item.items():
                _utf8(k)
                stack.append((v, depth + 1))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


INT64 = 1 << 63


def check_storable(value: Any) -> None:
    """What both SQL catalogs store the same way: no NUL in a string (PostgreSQL text
    cannot hold one, SQLite keeps it) and integers within a signed 64-bit column. Checked
    where untrusted JSON enters, so SQLite does not accept what PostgreSQL would fail on."""
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\0" in item:
                raise RejectedJSON("string holds a NUL character")
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int):
            if not -INT64 <= item < INT64:
                raise RejectedJSON(f"integer {str(item)[:24]} does not fit 64 bits")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start:e.end].encode("unicode_escape").decode("ascii")
        raise RejectedJSON(f"string holds a lone surrogate ({bad})") from None

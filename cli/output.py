"""One output sink: human text by default, JSON (NDJSON for streams) with --json."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

# rich is imported where it is used: a command that prints no table or bar (and
# `kvgraft --version`) should not pay for loading it.

# C0 and C1 controls (ESC starts CSI and OSC sequences, BEL/ST end them), DEL, and the
# bidirectional overrides and line separators that make text display as something else.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029"
                     "\u202a-\u202e\u2066-\u2069]")


def safe(value: object) -> str:
    """`value` as text that cannot drive a terminal: stored strings (model names, labels,
    actors, messages) are someone else's input. Human output always goes through this;
    JSON output stays exact."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"),
                       str(value))


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, sort_keys=True, default=str))


def emit_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(soft_wrap=True)
    table = Table(*headers, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        # Text, not str: rich would read "[...]" in a stored string as markup.
        table.add_row(*(Text(safe(c)) for c in row))
    console.print(table)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A transfer bar on stderr when it is a terminal; a no-op callback otherwise."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda n: None
        return
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def err(message: str) -> None:
    click.echo(safe(message), file=sys.stderr)


def echo(text: object) -> None:
    """One line of human output on stdout, made safe for a terminal."""
    click.echo(safe(text))

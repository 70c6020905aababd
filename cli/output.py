"""One output sink: human text by default, JSON (NDJSON for streams) with --json."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

# rich is imported where it is used: a command that prints no table or bar (and
# `kvgraft --version`) should not pay for loading it.


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, sort_keys=True, default=str))


def emit_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    table = Table(*headers, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        table.add_row(*(str(c) for c in row))
    console.print(table)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


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
    click.echo(message, file=sys.stderr)

"""One output sink: human text by default, JSON (NDJSON for streams) with --json."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, sort_keys=True, default=str))


def emit_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    console = Console(soft_wrap=True)
    table = Table(*headers, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        table.add_row(*(str(c) for c in row))
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

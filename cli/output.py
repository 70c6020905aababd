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


def print_fidelity(report: Any, engine: str | None = None) -> None:
    """A kvgraft.integrations.fidelity.FidelityReport, for people (`engine`: what ran it)."""
    s = report.summary()
    on = f" on {engine}" if engine else ""
    greedy = "same" if s["greedy_identical"] else "differ"
    click.echo(f"graft {report.reference} ({report.digest.short}){on}: {report.prefix_tokens} "
               f"prefix tokens, {len(report.suffix_tokens)} suffix tokens, "
               f"{s['greedy_steps']} greedy tokens ({greedy})")
    click.echo(f"{'phase':<7} {'pos':>4}  {'same':<4}  {'argmax g/f':<13} {'max|diff|':>9}  "
               "logits sha256 (graft)")
    for p in report.positions:
        click.echo(f"{p.phase:<7} {p.index:>4}  {'yes' if p.identical else 'NO':<4}  "
                   f"{p.graft_argmax:>6}/{p.fresh_argmax:<6} {p.max_abs_diff:>9.3g}  "
                   f"{p.graft_sha256[:16]}")
    click.echo(f"argmax agreement {s['argmax_agreement']:.0%}, max KL {s['max_kl']:.3g}, "
               f"max |diff| {s['max_abs_diff']:.3g}")
    if report.recompute is not None:
        r = report.recompute
        state = "all match the graft" if r["ok"] else f"{len(r['mismatches'])} differ"
        click.echo(f"recompute: {r['checked']} tensors, {state}")
    verdict = "BYTE-IDENTICAL" if report.byte_identical else "DIFFERENT"
    att = f", attestation #{report.attestation}" if report.attestation is not None else ""
    click.echo(f"result: {verdict}{att}")

"""`kvgraft stats` and `kvgraft doctor`: what a registry holds and uses, and whether the
environment kvgraft runs in works."""

from __future__ import annotations

import sys

import click

from kvgraft.cli.common import current_registry, json_option
from kvgraft.cli.output import echo, emit_json, emit_table, human_bytes


@click.command()
@click.argument("repository", required=False)
@json_option
@click.pass_context
def stats(ctx: click.Context, repository: str | None, as_json: bool) -> None:
    """Artifacts, bytes stored and saved by deduplication, hits and last use, by repository
    (REPOSITORY: a name or a shell glob). Hits are the restore, pull and match events of
    the audit log; through a server, only repositories the token may pull."""
    report = current_registry(ctx).stats(repository)
    if as_json:
        emit_json(report.to_json())
        return
    rows = [*report.repositories, report.total] if report.repositories else []
    emit_table(["REPOSITORY", "ARTIFACTS", "TAGS", "SIZE", "STORED", "DEDUPLICATED", "HITS",
                "LAST USED"],
               [[r.repository if r is not report.total else "(total)", r.artifacts, r.tags,
                 human_bytes(r.size), human_bytes(r.stored_bytes),
                 human_bytes(r.deduplicated_bytes), r.hits,
                 r.last_used.isoformat(timespec="seconds") if r.last_used else "never"]
                for r in rows])


@click.command()
@json_option
@click.pass_context
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check the environment: extras, catalog, store, machine cache, server remote. Exit 0
    when all is well, 1 listing each problem and its fix."""
    from kvgraft.services.doctor import examine

    report = examine(current_registry(ctx).config)
    if as_json:
        emit_json(report.to_json())
    else:
        for check in report.checks:
            mark = {"ok": "ok  ", "problem": "FAIL", "skipped": "-   "}[check.status]
            echo(f"{mark} {check.name}: {check.detail}")
            if check.status == "problem" and check.fix:
                echo(f"     fix: {check.fix}")
        problems = report.problems
        echo(f"{len(problems)} problem(s)" if problems else "all is well")
    if report.problems:
        sys.exit(1)


COMMANDS = [stats, doctor]

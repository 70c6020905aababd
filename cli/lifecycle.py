"""`kvgraft pin`, `unpin` and `quota`: what gc --unused-for and quotas may not take, and
how much a repository may hold (kvgraft.catalog.lifecycle)."""

from __future__ import annotations

import click

from kvgraft.cli.common import current_registry, json_option, parse_size
from kvgraft.cli.output import echo, emit_json, emit_table, err, human_bytes


@click.command()
@click.argument("ref")
@click.pass_context
def pin(ctx: click.Context, ref: str) -> None:
    """Exempt REF from `gc --unused-for` and from quota eviction in its repository."""
    digest = current_registry(ctx).pin(ref)
    err(f"pinned {ref}")
    click.echo(str(digest))


@click.command()
@click.argument("ref")
@click.pass_context
def unpin(ctx: click.Context, ref: str) -> None:
    """Let gc and quotas take REF again."""
    digest = current_registry(ctx).unpin(ref)
    err(f"unpinned {ref}")
    click.echo(str(digest))


@click.group()
def quota() -> None:
    """Byte quotas of repositories: a push past one evicts the repository's least recently
    used unpinned artifacts, or is refused when that cannot make room."""


@quota.command("set")
@click.argument("repository")
@click.argument("size")
@click.pass_context
def quota_set(ctx: click.Context, repository: str, size: str) -> None:
    """Limit REPOSITORY to SIZE of stored blobs (200GiB, 1.5TB, 512MiB)."""
    limit = parse_size(size)
    previous = current_registry(ctx).set_quota(repository, limit)
    was = f" (was {human_bytes(previous)})" if previous is not None else ""
    err(f"{repository}: quota {human_bytes(limit)}{was}")


@quota.command("rm")
@click.argument("repository")
@click.pass_context
def quota_rm(ctx: click.Context, repository: str) -> None:
    """Remove REPOSITORY's quota."""
    previous = current_registry(ctx).set_quota(repository, None)
    err(f"{repository}: no quota" + (f" (was {human_bytes(previous)})"
                                     if previous is not None else " (it had none)"))


@quota.command("ls")
@click.argument("pattern", required=False)
@json_option
@click.pass_context
def quota_ls(ctx: click.Context, pattern: str | None, as_json: bool) -> None:
    """Quotas and what each repository holds against its quota (PATTERN: a shell glob)."""
    found = current_registry(ctx).quotas(pattern)
    if as_json:
        emit_json({"quotas": [q.to_json() for q in found]})
        return
    if not found:
        echo("no quotas")
        return
    emit_table(["REPOSITORY", "QUOTA", "HELD", "USED"],
               [[q.repository, human_bytes(q.max_bytes), human_bytes(q.held_bytes),
                 f"{100 * q.held_bytes / q.max_bytes:.0f}%" if q.max_bytes else "-"]
                for q in found])


COMMANDS = [pin, unpin, quota]

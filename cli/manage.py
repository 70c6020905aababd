"""Commands for the local machine's view of registries: remotes, copy and the pull cache."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvgraft.cli.common import current_registry, json_option, parse_duration
from kvgraft.cli.output import emit_json, emit_table, err, human_bytes
from kvgraft.config import Config
from kvgraft.configfile import Remote, add_remote, load_remotes, remove_remote
from kvgraft.errors import UsageError
from kvgraft.reference import Reference

if TYPE_CHECKING:
    from kvgraft.client import Registry


@click.group()
def remote() -> None:
    """Named registries in $KVGRAFT_HOME/config.toml."""


@remote.command("add")
@click.argument("name")
@click.argument("url", required=False)
@click.option("--catalog", "catalog_url", default="", help="Catalog URL.")
@click.option("--store", "blob_url", default="", help="Blob store URL.")
@click.option("--token-file", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="With URL (a `kvgraft serve`): the file holding the token.")
@click.option("--cache", "cache_dir", type=click.Path(path_type=Path), help="Cache directory.")
@click.option("--replace", is_flag=True, help="Overwrite an existing remote of that name.")
@click.pass_context
def remote_add(ctx: click.Context, name: str, url: str | None, catalog_url: str,
               blob_url: str, token_file: Path | None, cache_dir: Path | None,
               replace: bool) -> None:
    """Add a remote NAME: a catalog and a store (--catalog, --store), or the URL of a
    `kvgraft serve` and --token-file."""
    home = current_registry(ctx).config.home
    add_remote(home, Remote(name, catalog_url, blob_url, cache_dir, url, token_file),
               replace=replace)
    err(f"added remote {name}")


@remote.command("ls")
@json_option
@click.pass_context
def remote_ls(ctx: click.Context, as_json: bool) -> None:
    """List remotes."""
    remotes = load_remotes(current_registry(ctx).config.home).values()
    if as_json:
        for r in remotes:
            emit_json({"name": r.name, "catalog": r.catalog_url, "store": r.blob_url,
                       "cache": str(r.cache_dir) if r.cache_dir else None, "url": r.url})
        return
    from kvgraft.catalog.engine import safe_url

    emit_table(["NAME", "CATALOG", "STORE", "CACHE"],
               [(r.name, safe_url(r.catalog_url) if r.url is None else r.url,
                 r.blob_url or "-", r.cache_dir or "-")
                for r in remotes])


@remote.command("rm")
@click.argument("name")
@click.pass_context
def remote_rm(ctx: click.Context, name: str) -> None:
    """Remove the remote NAME (nothing in it is deleted)."""
    remove_remote(current_registry(ctx).config.home, name)
    err(f"removed remote {name}")


@click.command("copy")
@click.argument("src")
@click.argument("dst")
@click.option("--token-file", type=click.Path(path_type=Path, dir_okay=False),
              help="The token or password for an OCI registry side (oci://…).")
@click.option("--username", default="kvgraft", show_default=True,
              help="The user name sent with --token-file (Basic credentials).")
@json_option
@click.pass_context
def copy(ctx: click.Context, src: str, dst: str, token_file: Path | None, username: str,
         as_json: bool) -> None:
    """Copy SRC (a reference in the current registry) to DST (REMOTE/name[:tag]).

    Only blobs the target lacks are transferred. Either side may be an OCI registry,
    oci://host[:port]/repository[:tag] (oci+http:// for plain HTTP): DST mirrors the graft
    there; SRC copies a mirrored graft back into the current registry as DST (name[:tag])."""
    reg = current_registry(ctx)
    if "://" in src or "://" in dst:
        _copy_oci(reg, src, dst, token_file, username, as_json)
        return
    remote_name, slash, rest = dst.partition("/")
    if not slash or not rest:
        raise UsageError(f"the target is REMOTE/name[:tag], got {dst!r}")
    from kvgraft.client import Registry

    target = Registry(Config.from_env({"KVGRAFT_HOME": str(reg.config.home)},
                                      remote=remote_name))
    try:
        digest, stats = reg.copy(Reference.parse(src), target, Reference.parse(rest))
    finally:
        target.close()
    if as_json:
        emit_json({"digest": str(digest), "target": dst, "blobs_copied": stats.copied,
                   "bytes_copied": stats.copied_bytes, "blobs": len(stats.blobs)})
        return
    err(f"copied {src} to {dst}: {stats.copied} of {len(stats.blobs)} blobs transferred "
        f"({human_bytes(stats.copied_bytes)})")
    click.echo(str(digest))


def _copy_oci(reg: Registry, src: str, dst: str, token_file: Path | None, username: str,
              as_json: bool) -> None:
    from kvgraft.fsutil import read_bounded
    from kvgraft.oci.client import Credentials, OciClient, OciLocation
    from kvgraft.oci.mirror import pull_graft, push_graft

    if "://" in src and "://" in dst:
        raise UsageError("one side of the copy is the current registry",
                         hint="copy from the OCI registry into it, then out to the other")
    creds = None
    if token_file is not None:
        secret = read_bounded(token_file, 4096, "token file").decode("utf-8", "replace")
        creds = Credentials(username, secret.strip())
    loc = OciLocation.parse(dst if "://" in dst else src)
    client = OciClient(loc.registry_url, creds)
    try:
        if "://" in dst:
            stats = push_graft(reg, Reference.parse(src), client, loc)
        else:
            stats = pull_graft(client, loc, reg, Reference.parse(dst))
    finally:
        client.close()
    if as_json:
        emit_json({"digest": str(stats.digest), "oci_digest": str(stats.oci_digest),
                   "target": dst, "blobs_copied": stats.copied,
                   "bytes_copied": stats.copied_bytes, "blobs": stats.blobs})
        return
    err(f"copied {src} to {dst}: {stats.copied} of {stats.blobs} blobs transferred "
        f"({human_bytes(stats.copied_bytes)}); OCI manifest {stats.oci_digest}")
    click.echo(str(stats.digest))


@click.group()
def cache() -> None:
    """The per-machine pull cache."""


@cache.command("ls")
@json_option
@click.pass_context
def cache_ls(ctx: click.Context, as_json: bool) -> None:
    """List cached artifacts and how much of each is present."""
    arts = current_registry(ctx).cache.artifacts()
    if as_json:
        for a in arts:
            emit_json({"digest": str(a.digest), "refs": list(a.refs), "size": a.size,
                       "cached_bytes": a.cached_bytes, "complete": a.complete,
                       "last_used": a.last_used})
        return
    emit_table(["DIGEST", "REFS", "SIZE", "CACHED"],
               [(a.digest.short, ", ".join(a.refs) or "-", human_bytes(a.size),
                 "complete" if a.complete else human_bytes(a.cached_bytes)) for a in arts])


@cache.command("prune")
@click.option("--older-than", help="Forget artifacts not used for this long (e.g. 7d).")
@click.option("--all", "everything", is_flag=True, help="Empty the cache.")
@click.option("--dry-run", is_flag=True, help="Only say what would be removed.")
@json_option
@click.pass_context
def cache_prune(ctx: click.Context, older_than: str | None, everything: bool, dry_run: bool,
                as_json: bool) -> None:
    """Remove cached blobs no remembered artifact needs (and old artifacts with --older-than)."""
    seconds = parse_duration(older_than) if older_than else None
    report = current_registry(ctx).cache.prune(older_than=seconds, everything=everything,
                                        dry_run=dry_run)
    if as_json:
        emit_json({"artifacts": report.artifacts, "blobs": report.blobs,
                   "bytes_freed": report.bytes_freed, "dry_run": dry_run})
        return
    verb = "would free" if dry_run else "freed"
    err(f"{verb} {human_bytes(report.bytes_freed)}: {report.blobs} blobs, "
        f"{report.artifacts} artifacts")


COMMANDS = [remote, copy, cache]

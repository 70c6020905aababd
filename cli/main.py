"""`kvgraft`: push, pull, list, inspect, tag and verify KV grafts."""

from __future__ import annotations

import dataclasses
import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvgraft import __version__
from kvgraft.cli.common import (
    LazyChoice,
    current_registry,
    json_option,
    parse_labels,
    policy_options,
)
from kvgraft.cli.errors import run_guarded
from kvgraft.cli.output import echo, emit_json, emit_table, err, human_bytes, progress_bar
from kvgraft.errors import IntegrityError, UsageError

if TYPE_CHECKING:
    from kvgraft.reference import Reference

DEFAULT_CODEC = "auto"  # kvgraft.codecs.codec.DEFAULT_CODEC, without importing the codecs here


def _codec_names() -> list[str]:
    from kvgraft.codecs.codec import push_codec_names

    return push_codec_names()


# Subcommands defined in the other command modules, by module: imported only when one of
# them runs (or --help lists them), so `kvgraft --version` and `kvgraft ls` load neither.
# tests/test_startup.py checks this table against each module's COMMANDS.
LAZY_COMMANDS = {
    "kvgraft.cli.manage": ("remote", "copy", "cache"),
    "kvgraft.cli.graft": ("fingerprint", "capture", "check", "graft", "verify-graft", "match"),
    "kvgraft.cli.audit": ("log", "provenance", "key", "trust", "sign", "audit", "gc"),
    "kvgraft.cli.lifecycle": ("pin", "unpin", "quota"),
    "kvgraft.cli.server": ("serve", "token"),
    "kvgraft.cli.ops": ("stats", "doctor"),
}
_MODULE_OF = {name: module for module, names in LAZY_COMMANDS.items() for name in names}


class GuardedGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        return run_guarded(lambda: super(GuardedGroup, self).invoke(ctx))

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *_MODULE_OF})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in _MODULE_OF:
            module = importlib.import_module(_MODULE_OF[cmd_name])
            command = next(c for c in module.COMMANDS if c.name == cmd_name)
            self.add_command(command)
        return command


def _ref(text: str) -> Reference:
    from kvgraft.reference import Reference

    return Reference.parse(text)


@click.group(cls=GuardedGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvgraft")
@click.option("--home", type=click.Path(path_type=Path), help="Overrides $KVGRAFT_HOME.")
@click.option("--catalog", "catalog_url", help="Catalog URL (overrides $KVGRAFT_CATALOG_URL).")
@click.option("--store", "blob_url", help="Blob store URL (overrides $KVGRAFT_BLOB_URL).")
@click.option("--cache", "cache_dir", type=click.Path(path_type=Path),
              help="Pull cache directory (overrides $KVGRAFT_CACHE).")
@click.option("--remote", help="A remote from $KVGRAFT_HOME/config.toml (or $KVGRAFT_REMOTE).")
@click.option("--offline", is_flag=True, default=None,
              help="Serve only from the local cache: no catalog or store access.")
@click.pass_context
def cli(ctx: click.Context, home: Path | None, catalog_url: str | None, blob_url: str | None,
        cache_dir: Path | None, remote: str | None, offline: bool | None) -> None:
    """kvgraft: a content-addressed registry for byte-exact KV-cache grafts."""
    from kvgraft.client import Registry
    from kvgraft.config import Config

    env = dict(os.environ)
    if home is not None:
        env["KVGRAFT_HOME"] = str(home)
    config = Config.from_env(env, remote=remote, catalog_url=catalog_url, blob_url=blob_url,
                             cache_dir=cache_dir, offline=offline or None)
    registry = Registry(config)
    ctx.obj = registry
    ctx.call_on_close(registry.close)


@cli.command()
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("ref")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="Repeatable.")
@click.option("--chunk-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--codec", type=LazyChoice(_codec_names), default=DEFAULT_CODEC,
              show_default=True, help="auto: byte planes for float tensors, zstd otherwise.")
@click.option("--level", type=int, default=None, help="Codec level (zstd: -7..22, default 1).")
@click.option("--parent", "parents", multiple=True, metavar="REF",
              help="An artifact this one derives from (repeatable).")
@click.option("--from-llama-state", "llama_state", is_flag=True,
              help="FILE is a llama.cpp seq-state file (slot save); needs --model X.gguf.")
@click.option("--model", "model", default=None, metavar="GGUF",
              help="With --from-llama-state: the GGUF file llama.cpp ran.")
@json_option
@click.pass_context
def push(ctx: click.Context, file: Path, ref: str, labels: tuple[str, ...], chunk_tokens: int,
         codec: str, level: int | None, parents: tuple[str, ...], llama_state: bool,
         model: str | None, as_json: bool) -> None:
    """Push the KV file FILE as REF (name[:tag]); prints the artifact digest."""
    from kvgraft.transfer.push import PushOptions

    reg = current_registry(ctx)
    if llama_state or model is not None:
        from kvgraft.cli.llamacpp import from_llama_state

        file = from_llama_state(ctx, file, model, llama_state)
    reference = _ref(ref)
    options = PushOptions(chunk_tokens=chunk_tokens, codec=codec, level=level,
                          parents=tuple(reg.resolve(p) for p in parents))
    size = file.stat().st_size if file.is_file() else 0
    with progress_bar(f"push {reference}", size) as advance:
        result = reg.push(file, reference, labels=parse_labels(labels), options=options,
                          progress=advance)
    for warning in result.warnings:
        err(f"warning: {warning} (the push itself succeeded)")
    if result.evicted:
        err(f"{reference.name} is at its quota: evicted {len(result.evicted)} least recently "
            "used artifact(s) there (`kvgraft log --action evict` lists them)")
    if as_json:
        emit_json({"digest": str(result.digest), "reference": str(result.reference),
                   "created": result.created, "blobs_stored": result.blobs_stored,
                   "bytes_stored": result.bytes_stored, "size": result.size,
                   "stored_size": result.stored_size, "token_count": result.token_count,
                   "previous": str(result.previous) if result.previous else None,
                   "evicted": [str(d) for d in result.evicted]})
        return
    err(f"pushed {reference}: {result.token_count} tokens, {human_bytes(result.size)} "
        f"({human_bytes(result.stored_size)} stored, {human_bytes(result.bytes_stored)} new)")
    click.echo(str(result.digest))


@cli.command()
@click.argument("ref")
@click.option("--output", "-o", type=click.Path(path_type=Path, dir_okay=False),
              help="Write the original KV file here.")
@policy_options
@click.option("--offline", is_flag=True,
              help="Serve only from the local cache (like the global --offline).")
@click.option("--llama-state", is_flag=True,
              help="Write --output as a llama.cpp seq-state file (a llama.cpp graft).")
@json_option
@click.pass_context
def pull(ctx: click.Context, ref: str, output: Path | None, signed_by: tuple[str, ...],
         require_verified: bool, offline: bool, llama_state: bool, as_json: bool) -> None:
    """Pull REF into the local cache, verifying every byte; --output rebuilds the file."""
    if llama_state:
        from kvgraft.cli.llamacpp import pull_llama_state

        pull_llama_state(ctx, ref, output, signed_by, require_verified, offline, as_json)
        return
    reg = current_registry(ctx)
    if offline and not reg.config.offline:
        reg = type(reg)(dataclasses.replace(reg.config, offline=True))
        ctx.call_on_close(reg.close)
    reference = _ref(ref)
    if output is not None:
        from kvgraft.client import check_output

        check_output(output)  # a usage error before any catalog lookup
    total = reg.manifest(reg.resolve(reference)).size
    with progress_bar(f"pull {reference}", total) as advance:
        result = reg.pull(reference, output, progress=advance, require_signed_by=signed_by,
                          require_verified=require_verified)
    for warning in result.warnings:
        err(f"warning: {warning}")
    s = result.stats
    if as_json:
        emit_json({"digest": str(result.digest), "reference": str(reference),
                   "output": str(output) if output else None, "fetched": s.fetched,
                   "fetched_bytes": s.fetched_bytes, "cached": s.cached})
        return
    err(f"pulled {reference}: {s.fetched} blobs fetched ({human_bytes(s.fetched_bytes)}), "
        f"{s.cached} from cache" + (f", wrote {output}" if output else ""))
    click.echo(str(result.digest))


@cli.command("ls")
@click.argument("pattern", required=False)
@json_option
@click.pass_context
def ls(ctx: click.Context, pattern: str | None, as_json: bool) -> None:
    """List tagged artifacts, optionally those whose name matches the shell glob PATTERN
    (* any characters, ? one, [ab] one of a or b, [!ab] any other; quote it)."""
    problems: list[str] = []
    tags = current_registry(ctx).list(pattern, problems=problems)
    if as_json:
        for t in tags:
            emit_json({"repository": t.repository, "tag": t.tag, "digest": str(t.digest),
                       "updated_at": t.updated_at.isoformat()})
    else:
        emit_table(["NAME", "TAG", "DIGEST", "UPDATED"],
                   [(t.repository, t.tag, t.digest.short,
                     t.updated_at.strftime("%Y-%m-%d %H:%M")) for t in tags])
    if problems:  # listed what is sound; the damaged rows still fail the command
        raise IntegrityError(f"{len(problems)} damaged tag(s): " + "; ".join(problems))


@cli.command()
@click.argument("ref")
@json_option
@click.pass_context
def inspect(ctx: click.Context, ref: str, as_json: bool) -> None:
    """Show an artifact's manifest, model identity, tags and sizes."""
    info = current_registry(ctx).inspect(_ref(ref))
    if as_json:
        emit_json(info.to_json())
        return
    r, m = info.record, info.manifest
    rows = [
        ("digest", str(r.digest)),
        ("tags", ", ".join(f"{t.repository}:{t.tag}" for t in r.tags) or "-"),
        ("model", m.model_name or "-"),
        ("architecture", str(m.model.architecture)),
        ("tokenizer", str(m.model.tokenizer)),
        ("weights", str(m.model.weights) if m.model.weights else "-"),
        ("tokens", f"{m.token_count} in {len(m.chunks)} chunks of {m.chunk_tokens}"),
        ("layers", str(len(m.layers))),
        ("size", f"{human_bytes(r.size)} ({human_bytes(r.stored_size)} stored)"),
        ("file", f"{m.file_digest} ({human_bytes(m.file_size)}; "
                 + ("tree of its blobs, format 2)" if m.version >= 2 else "SHA-256, format 1)")),
        ("parents", ", ".join(str(p) for p in m.parents) or "-"),
        ("labels", ", ".join(f"{k}={v}" for k, v in sorted(r.labels.items())) or "-"),
        ("created", r.created_at.isoformat()),
        ("last used", r.last_used.isoformat() if r.last_used else "never since pushed"),
        ("pinned in", ", ".join(r.pinned) or "-"),
    ]
    for key, value in rows:
        echo(f"{key:<13} {value}")


@cli.command()
@click.argument("ref")
@click.argument("new_ref")
@click.pass_context
def tag(ctx: click.Context, ref: str, new_ref: str) -> None:
    """Point NEW_REF (name:tag) at the artifact REF names."""
    digest = current_registry(ctx).tag(_ref(ref), _ref(new_ref))
    err(f"tagged {new_ref}")
    click.echo(str(digest))


@cli.command()
@click.argument("ref")
@click.pass_context
def untag(ctx: click.Context, ref: str) -> None:
    """Remove the tag REF (the artifact stays, addressable by digest)."""
    digest = current_registry(ctx).untag(_ref(ref))
    err(f"untagged {ref} (was {digest.short})")


@cli.command()
@click.argument("ref", required=False)
@click.option("--all", "all_", is_flag=True, help="Verify every artifact in the catalog.")
@click.option("--repair", is_flag=True,
              help="Replace bad or missing blobs with good bytes from the local cache, "
                   "then verify again.")
@click.option("--repair-from", "source", type=click.Path(path_type=Path, dir_okay=False),
              help="Like --repair, taking the bytes from FILE, the KV file REF was pushed "
                   "from.")
@json_option
@click.pass_context
def verify(ctx: click.Context, ref: str | None, all_: bool, repair: bool, source: Path | None,
           as_json: bool) -> None:
    """Re-read every blob of REF (or --all) from the store and check size and digest."""
    if (ref is None) == (not all_):
        raise UsageError("give a REF or --all (not both)")
    if source is not None and ref is None:
        raise UsageError("--repair-from FILE repairs one REF, not --all")
    reg = current_registry(ctx)
    reports = reg.verify(_ref(ref) if ref else None)
    if (repair or source is not None) and any(not r.ok for r in reports):
        for r in reports:
            if not r.ok:
                left = reg.repair(r, source)
                err(f"repaired {len(r.bad) - len(left)} of {len(r.bad)} bad blob(s) of "
                    f"{r.artifact.short}" + (" (the rest are not in the cache)" if left else ""))
        reports = reg.verify(_ref(ref) if ref else None)
    tag_problems = reg.verify_tags() if all_ else ()
    failures = [f"{r.artifact.short}: {p}" for r in reports for p in r.problems]
    failures += [f"blob {b.digest} of {r.artifact.short}: {b.reason}"
                 for r in reports for b in r.bad]
    failures += list(tag_problems)
    if as_json:
        for r in reports:
            emit_json({"digest": str(r.artifact), "ok": r.ok, "checked": r.checked,
                       "checked_bytes": r.checked_bytes, "problems": list(r.problems),
                       "bad": [{"digest": str(b.digest), "reason": b.reason} for b in r.bad]})
        for p in tag_problems:  # one line per damaged tag, after the artifacts
            emit_json({"ok": False, "problem": p})
    else:
        for r in reports:
            state = "ok" if r.ok else "; ".join(
                [*r.problems] + ([f"{len(r.bad)} bad blob(s)"] if r.bad else []))
            echo(f"{r.artifact}  {r.checked} blobs, {human_bytes(r.checked_bytes)}: {state}")
        for p in tag_problems:
            echo(p)
    if failures:
        raise IntegrityError(f"verification failed ({len(failures)} problem(s)): "
                             + "; ".join(failures))


# A server's catalog is migrated where it runs: through a server there is no catalog here
# (opening one would quietly make a local one instead).
_DB_DIRECT = "run it on the server's host with a direct remote (--catalog, --store)"


@cli.group()
def db() -> None:
    """Catalog schema migrations."""


@db.command("upgrade")
@click.pass_context
def db_upgrade(ctx: click.Context) -> None:
    """Migrate the catalog to this kvgraft's schema."""
    from kvgraft.catalog import Catalog
    from kvgraft.catalog.schema import head_revision

    reg = current_registry(ctx)
    reg.owner_only("db upgrade", _DB_DIRECT)
    reg.require_online("the catalog")
    catalog = Catalog.open(reg.config.catalog_url, auto_upgrade=True)
    catalog.close()
    err(f"catalog at revision {head_revision()}")


@db.command("current")
@json_option
@click.pass_context
def db_current(ctx: click.Context, as_json: bool) -> None:
    """Print the catalog's schema revision and the one this kvgraft needs."""
    from kvgraft.catalog import Catalog
    from kvgraft.catalog.engine import make_engine, safe_url
    from kvgraft.catalog.schema import head_revision

    reg = current_registry(ctx)
    reg.owner_only("db current", _DB_DIRECT)
    reg.require_online("the catalog")
    catalog = Catalog(make_engine(reg.config.catalog_url), reg.config.catalog_url)
    current, head = catalog.current_revision(), head_revision()
    catalog.close()
    if as_json:
        emit_json({"catalog": safe_url(reg.config.catalog_url), "current": current,
                   "head": head, "up_to_date": current == head})
        return
    click.echo(f"{current or 'none'} (head {head}{', up to date' if current == head else ''})")


def main() -> None:
    cli(prog_name="kvgraft")


"""Commands for trust and housekeeping: the event log, provenance, keys, signing, audit, gc."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvgraft.cli.common import current_registry, json_option, parse_duration
from kvgraft.cli.output import echo, emit_json, emit_table, err, human_bytes
from kvgraft.errors import IntegrityError, Unavailable, UsageError
from kvgraft.fsutil import atomic_writer
from kvgraft.reference import Reference

if TYPE_CHECKING:
    from kvgraft.provenance.audit import AuditReport


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """An ISO 8601 time (local time when it names no zone) or a duration ago (24h, 7d)."""
    if re.fullmatch(r"\s*[0-9]+[smhdw]?\s*", text):
        return (now or datetime.now(UTC)) - timedelta(seconds=parse_duration(text))
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(f"not a time or duration: {text!r}",
                         hint="use e.g. 2026-12-01T09:00, 2026-12-01 or 24h") from None
    try:
        return (t if t.tzinfo else t.astimezone()).astimezone(UTC)
    except (ValueError, OverflowError):  # local time at the edges of year 1 or 9999
        raise UsageError(f"time {text!r} is out of range",
                         hint="give a time between years 2 and 9998") from None


def _write(output: Path | None, lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    if output is None:
        click.echo(text, nl=False)
        return
    with atomic_writer(output) as f:
        f.write(text.encode())
    err(f"wrote {len(lines)} document(s) to {output}")


# --- the event log ---------------------------------------------------------------------

@click.command("log")
@click.argument("ref", required=False)
@click.option("--since", help="Only events since a time (ISO 8601) or a duration ago (24h).")
@click.option("--action", help="Only this action (push, pull, tag, untag, sign, gc, …).")
@json_option
@click.pass_context
def log(ctx: click.Context, ref: str | None, since: str | None, action: str | None,
        as_json: bool) -> None:
    """List audit events, oldest first (of the artifact REF names, if given)."""
    events = current_registry(ctx).log(Reference.parse(ref) if ref else None,
                                since=parse_since(since) if since else None, action=action)
    if as_json:
        for e in events:
            emit_json({"id": e.id, "at": e.at.isoformat() if e.at else None,
                       "actor": e.actor, "host": e.host, "action": e.action,
                       "repository": e.repository, "tag": e.tag,
                       "digest": str(e.digest) if e.digest else None,
                       "outcome": e.outcome, "detail": dict(e.detail)})
        return
    emit_table(["TIME", "ACTOR", "ACTION", "REFERENCE", "DIGEST", "OUTCOME"],
               [(e.at.astimezone().strftime("%Y-%m-%d %H:%M:%S") if e.at else "-", e.actor,
                 e.action, f"{e.repository}:{e.tag}" if e.repository and e.tag
                 else e.repository or "-", e.digest.short if e.digest else "-", e.outcome)
                for e in events])


# --- provenance ------------------------------------------------------------------------

@click.group()
def provenance() -> None:
    """in-toto provenance statements of artifacts."""


@provenance.command("export")
@click.argument("ref")
@click.option("--output", "-o", type=click.Path(path_type=Path, dir_okay=False),
              help="Write here instead of stdout.")
@click.option("--signed", is_flag=True,
              help="Only the DSSE envelopes of signed attestations (for DSSE verifiers).")
@click.pass_context
def provenance_export(ctx: click.Context, ref: str, output: Path | None, signed: bool) -> None:
    """Write REF's in-toto statements as JSON lines: the kvgraft provenance statement
    derived from its manifest and first push, then every stored attestation."""
    statement, attestations = current_registry(ctx).provenance(Reference.parse(ref))
    if signed:
        lines = [a.envelope.decode() for a in attestations if a.envelope is not None]
        if not lines:
            raise UsageError(f"{ref} has no signed attestations",
                             hint=f"sign it with `kvgraft sign {ref} --key NAME`")
    else:
        lines = [statement.canonical().decode()] + [a.statement.decode() for a in attestations]
    _write(output, lines)


# --- keys and trust --------------------------------------------------------------------

@click.group()
def key() -> None:
    """Ed25519 signing keys in $KVGRAFT_HOME/keys."""


@key.command("generate")
@click.argument("name")
@json_option
@click.pass_context
def key_generate(ctx: click.Context, name: str, as_json: bool) -> None:
    """Generate the key NAME (trusted by this configuration from the start)."""
    public = current_registry(ctx).keyring.generate(name)
    if as_json:
        emit_json(public.to_json())
        return
    err(f"generated key {name}; its public half is trusted here. Share it with "
        f"`kvgraft key export {name}`")
    click.echo(public.keyid)


@key.command("ls")
@json_option
@click.pass_context
def key_ls(ctx: click.Context, as_json: bool) -> None:
    """List this keyring's keys and the trusted public keys."""
    infos = current_registry(ctx).keyring.listing()
    if as_json:
        for i in infos:
            emit_json({"name": i.name, "keyid": i.keyid, "private": i.private,
                       "trusted": i.trusted})
        return
    emit_table(["NAME", "KEYID", "PRIVATE", "TRUSTED"],
               [(i.name or "-", i.keyid, "yes" if i.private else "-",
                 "yes" if i.trusted else "-") for i in infos])


@key.command("export")
@click.argument("name")
@click.option("--pem", is_flag=True, help="PEM (SubjectPublicKeyInfo) instead of JSON.")
@click.option("--output", "-o", type=click.Path(path_type=Path, dir_okay=False))
@click.pass_context
def key_export(ctx: click.Context, name: str, pem: bool, output: Path | None) -> None:
    """Print the public key NAME (a securesystemslib key document, or PEM)."""
    public = current_registry(ctx).keyring.public(name)
    text = public.pem().decode().rstrip("\n") if pem else json.dumps(public.to_json(),
                                                                      sort_keys=True)
    _write(output, [text])


@click.group()
def trust() -> None:
    """The trust store: public keys whose signatures this configuration accepts."""


@trust.command("add")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@click.pass_context
def trust_add(ctx: click.Context, file: Path) -> None:
    """Trust the public key in FILE (from `kvgraft key export`, JSON or PEM)."""
    public, added = current_registry(ctx).keyring.trust_file(file)
    err(f"{'trusted' if added else 'already trusted'}: {public.name or 'key'} {public.keyid}")
    click.echo(public.keyid)


# --- signing and audit -----------------------------------------------------------------

@click.command("sign")
@click.argument("ref")
@click.option("--key", "key_name", required=True, help="A key from `kvgraft key ls`.")
@json_option
@click.pass_context
def sign(ctx: click.Context, ref: str, key_name: str, as_json: bool) -> None:
    """Sign REF's provenance statement (a DSSE envelope, stored as an attestation)."""
    digest, keyid, att_id = current_registry(ctx).sign(Reference.parse(ref), key_name)
    if as_json:
        emit_json({"digest": str(digest), "keyid": keyid, "attestation": att_id})
        return
    err(f"signed {ref} with {key_name} ({keyid[:16]}), attestation {att_id}")
    click.echo(str(digest))


def _row(label: str, value: object) -> None:
    echo(f"  {label:<13} {value}")


def _print_audit(ref: str, r: AuditReport) -> None:
    echo(f"{ref} {r.digest}")
    _print_manifest(r)
    _print_provenance(r)
    _print_attestations(r)
    _print_events(r)
    echo("result: " + ("ok" if r.ok else f"{len(r.failures)} problem(s)"))
    for f in r.failures:
        echo(f"  - {f}")


def _print_manifest(r: AuditReport) -> None:
    echo("manifest")
    m = r.manifest
    if m is None:
        _row("problem", r.manifest_problem)
        return
    _row("tags", ", ".join(f"{t.repository}:{t.tag}" for t in r.record.tags) or "-")
    _row("tokens", f"{m.token_count} in {len(m.chunks)} chunks of {m.chunk_tokens}")
    _row("size", f"{human_bytes(m.size)} ({human_bytes(r.record.stored_size)} stored)")
    _row("file", f"{m.file_digest} ({human_bytes(m.file_size)})")
    echo("model")
    _row("name", m.model_name or "-")
    _row("architecture", m.model.architecture)
    _row("tokenizer", m.model.tokenizer)
    _row("weights", m.model.weights or "-")


def _print_provenance(r: AuditReport) -> None:
    if r.provenance is not None:
        echo("provenance")
        pred = r.provenance.predicate
        pushed = pred.get("pushed") or {}
        _row("pushed", f"{pushed.get('by', '-')} at {pushed.get('at', '-')}")
        for k, v in sorted(dict(pred.get("provenance", {})).items()):
            _row(k, json.dumps(v, sort_keys=True))
    echo("lineage")
    for p in r.parents:
        _row("parent", f"{p.digest} {'ok' if not p.problem else p.problem}")
    for c in r.children:
        _row("child", c)


def _print_attestations(r: AuditReport) -> None:
    echo("attestations")
    for a in r.attestations:
        who = f" signed by {', '.join(k[:16] for k in a.signers)}" if a.signers else \
            (" signed" if a.signed else " unsigned")
        _row(f"#{a.id}", f"{a.predicate_type}{who}: "
                         f"{'ok' if a.ok else '; '.join(a.problems)}")
    if r.blobs is not None:
        echo("blobs")
        _row("checked", f"{r.blobs.checked} ({human_bytes(r.blobs.checked_bytes)}): "
                        f"{'ok' if r.blobs.ok else f'{len(r.blobs.bad)} bad'}")


def _print_events(r: AuditReport) -> None:
    echo("events")
    for e in r.events:
        when = e.at.astimezone().strftime("%Y-%m-%d %H:%M:%S") if e.at else "-"
        _row(e.action, f"{when} {e.actor} {e.outcome}")
    head = r.chain.head
    _row("chain", f"{r.chain.events} events, head {head[0]} {head[1]}" if head else "empty")
    if head:  # the chain cannot show its newest events deleted together
        _row("", "record this head elsewhere: a later audit finding an older head has "
                 "found deleted events")


@click.command("audit")
@click.argument("ref")
@json_option
@click.pass_context
def audit(ctx: click.Context, ref: str, as_json: bool) -> None:
    """Everything about REF: manifest, model, provenance, lineage, attestations and
    signatures, every blob re-hashed, events. Exit 4 when anything fails to check out."""
    report = current_registry(ctx).audit(Reference.parse(ref))
    if as_json:
        emit_json(report.to_json())
    else:
        _print_audit(ref, report)
    if not report.ok:
        raise IntegrityError(f"audit of {ref} failed: " + "; ".join(report.failures))


# --- gc --------------------------------------------------------------------------------

@click.command("gc")
@click.option("--dry-run", is_flag=True, help="Print the plan; delete nothing.")
@click.option("--grace", default="24h", show_default=True,
              help="Never delete a blob stored more recently than this (in-flight pushes).")
@click.option("--untagged-older-than", "untagged",
              help="Also delete untagged artifacts older than this (default: keep all).")
@click.option("--unused-for", "unused",
              help="Also delete artifacts nobody restored, pulled or matched for this long, "
                   "tagged or not, unless a repository pins them (`kvgraft pin`).")
@click.option("--allow-empty-catalog", is_flag=True,
              help="Delete blobs even when the catalog holds no artifact at all (otherwise "
                   "refused: that is usually a lost or wrong catalog).")
@json_option
@click.pass_context
def gc(ctx: click.Context, dry_run: bool, grace: str, untagged: str | None,
       unused: str | None, allow_empty_catalog: bool, as_json: bool) -> None:
    """Delete unreferenced blobs (and, with --untagged-older-than, old untagged artifacts;
    with --unused-for, unpinned artifacts nobody used for that long)."""
    reg = current_registry(ctx)
    plan = reg.gc_plan(grace=parse_duration(grace),
                       untagged_older_than=parse_duration(untagged) if untagged else None,
                       unused_for=parse_duration(unused) if unused else None)
    summary = (f"{len(plan.artifacts)} artifact(s), {len(plan.blobs)} blob(s), "
               f"{human_bytes(plan.bytes_freed)}")
    if dry_run:
        if as_json:
            emit_json({"dry_run": True, "plan": plan.to_json()})
            return
        err(f"would delete {summary} (kept: {plan.kept_artifacts} artifacts, "
            f"{plan.kept_blobs} blobs, {plan.young_blobs} inside the grace period)")
        for d in plan.artifacts:
            click.echo(f"artifact {d}")
        for b in plan.blobs:
            click.echo(f"blob {b.digest} {human_bytes(b.stored_size)}")
        return
    result = reg.gc(plan, allow_empty_catalog=allow_empty_catalog)
    if as_json:
        emit_json(result.to_json())
    else:
        err(f"deleted {len(result.artifacts)} artifact(s), {len(result.blobs)} blob(s), "
            f"freed {human_bytes(result.bytes_freed)} (planned: {summary})")
    if result.errors:
        raise Unavailable(f"gc could not delete {len(result.errors)} blob(s): "
                             + "; ".join(result.errors[:5]))


COMMANDS = [log, provenance, key, trust, sign, audit, gc]

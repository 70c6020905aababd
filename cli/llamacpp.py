"""The model commands for a GGUF file, run on llama.cpp (the [llamacpp] extra).

`kvgraft fingerprint|capture|check|graft|verify-graft|match --model X.gguf` come here: the
engine is chosen from the model file (a `.gguf` name or the GGUF magic)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvgraft.cli.common import current_registry
from kvgraft.cli.output import echo, emit_json, err
from kvgraft.errors import IntegrityError, MissingExtra, UsageError
from kvgraft.reference import Reference

if TYPE_CHECKING:
    from kvgraft.client import Registry


def is_gguf(spec: str) -> bool:
    """Whether a --model value names a GGUF file (by its suffix or its first bytes)."""
    path = Path(spec)
    if spec.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _integration() -> Any:
    try:
        import kvgraft.integrations.llamacpp as llamacpp
    except MissingExtra as e:
        raise UsageError(f"a GGUF model: {e.message}", hint=e.hint) from None
    return llamacpp


def _no_dtype(dtype: str | None) -> None:
    if dtype is not None:
        raise UsageError("--dtype applies to model directories; llama.cpp runs a GGUF file "
                         "with an f16 KV cache")


def _load(reg: Registry, spec: str, threads: int | None) -> Any:
    llamacpp = _integration()
    if not Path(spec).is_file():
        raise UsageError(f"no such GGUF file: {spec}")
    return llamacpp.load_model(spec, cache_dir=reg.config.cache_dir,
                               settings=llamacpp.Settings(threads=threads))


def fingerprint(ctx: click.Context, spec: str, dtype: str | None, as_json: bool) -> None:
    _no_dtype(dtype)
    _integration()
    from kvgraft.integrations.llamacpp.engine import Settings, engine_fingerprint

    if not Path(spec).is_file():
        raise UsageError(f"no such GGUF file: {spec}")
    cache_dir = current_registry(ctx).config.cache_dir
    fp, plain = engine_fingerprint(spec, Settings(), cache_dir=cache_dir)
    if as_json:
        emit_json({**fp.to_json(), "key": str(fp.identity.key), "engine": fp.config["engine"],
                   "model": {**plain.identity.to_json(), "key": str(plain.identity.key)}})
        return
    ident = fp.identity
    for key, value in [("model", fp.name or "-"), ("architecture", str(ident.architecture)),
                       ("tokenizer", str(ident.tokenizer)), ("weights", str(ident.weights)),
                       ("identity", str(ident.key)), ("engine", "llama.cpp"),
                       ("kv dtype", fp.config.get("kv_dtype")),
                       ("layers", fp.config.get("num_hidden_layers"))]:
        echo(f"{key:<13} {value}")


def capture(ctx: click.Context, ref: str, spec: str, dtype: str | None, threads: int | None,
            text: str, output: Path | None, chunk_tokens: int, labels: dict[str, str],
            as_json: bool) -> None:
    import tempfile

    from kvgraft.transfer.push import PushOptions

    _no_dtype(dtype)
    reg = current_registry(ctx)
    reference = Reference.parse(ref)
    lm = _load(reg, spec, threads)
    with tempfile.TemporaryDirectory(prefix="kvgraft-capture-") as tmp:
        path = output or Path(tmp) / "graft.kv"
        cap = _integration().capture(lm, path, text=text)
        result = reg.push(cap.path, reference, labels=labels,
                          options=PushOptions(chunk_tokens=chunk_tokens))
    if as_json:
        emit_json({"digest": str(result.digest), "reference": str(reference),
                   "token_count": cap.token_count, "prefill_seconds": cap.seconds,
                   "next_token": cap.next_token, "blobs_stored": result.blobs_stored,
                   "size": result.size, "output": str(output) if output else None,
                   "engine": "llama.cpp"})
        return
    err(f"captured {cap.token_count} tokens in {cap.seconds:.2f} s on llama.cpp, pushed "
        f"{reference} ({result.blobs_stored} new blobs)")
    click.echo(str(result.digest))


def check(ctx: click.Context, ref: str, spec: str, dtype: str | None,
          signed_by: tuple[str, ...], require_verified: bool, as_json: bool) -> None:
    from kvgraft.identity.compat import compare

    _no_dtype(dtype)
    _integration()
    from kvgraft.integrations.llamacpp.engine import Settings, engine_fingerprint

    reg = current_registry(ctx)
    reference = Reference.parse(ref)
    if not Path(spec).is_file():
        raise UsageError(f"no such GGUF file: {spec}")
    live, _ = engine_fingerprint(spec, Settings(), cache_dir=reg.config.cache_dir)
    manifest = reg.open(reference, require_signed_by=signed_by,
                        require_verified=require_verified, model=live.identity,
                        action="check").manifest
    report = compare(manifest.model, manifest.model_config, live)
    if as_json:
        emit_json({"reference": str(reference), "digest": str(manifest.digest),
                   **report.to_json()})
    else:
        for m in report.mismatches:
            echo(f"MISMATCH {m.human()}")
        echo(f"{reference}: {'compatible' if report.ok else 'INCOMPATIBLE'}")
    report.check(f"graft {reference}")


def graft(ctx: click.Context, ref: str, spec: str, dtype: str | None, threads: int | None,
          prompt: str, max_new_tokens: int, force_incompatible: bool,
          signed_by: tuple[str, ...], require_verified: bool, as_json: bool) -> None:
    _no_dtype(dtype)
    reg = current_registry(ctx)
    lm = _load(reg, spec, threads)
    if force_incompatible:
        err("WARNING: --force-incompatible: a graft from another model gives wrong output "
            "silently; this use is recorded in the audit log")
    result, _ = _integration().graft_generate(
        reg, lm, Reference.parse(ref), prompt=prompt, max_new_tokens=max_new_tokens,
        force_incompatible=force_incompatible, require_signed_by=signed_by,
        require_verified=require_verified)
    if as_json:
        emit_json(result.to_json())
        return
    err(f"grafted {result.reused} of {result.prompt_tokens} prompt tokens on llama.cpp "
        f"(prefill skipped for {result.reused}, computed "
        f"{result.prompt_tokens - result.reused}); load {result.load_seconds:.3f} s, restore "
        f"{result.restore_seconds:.3f} s, generate {result.generate_seconds:.2f} s")
    click.echo(result.text)


def verify(ctx: click.Context, ref: str, spec: str, dtype: str | None, threads: int | None,
           suffix_text: str | None, steps: int, recompute: bool,
           signed_by: tuple[str, ...], as_json: bool) -> None:
    _no_dtype(dtype)
    reg = current_registry(ctx)
    lm = _load(reg, spec, threads)
    report = _integration().verify_graft(reg, lm, Reference.parse(ref), suffix=suffix_text,
                                         steps=steps, recompute=recompute,
                                         require_signed_by=signed_by)
    if as_json:
        emit_json(report.to_json())
    else:
        _print_report(report)
    if not report.ok:
        raise IntegrityError(f"graft {ref} is not byte-identical to llama.cpp's two-step "
                             "computation", hint="see the report above")


def _print_report(report: Any) -> None:
    s = report.summary()
    click.echo(f"graft {report.reference} ({report.digest.short}) on llama.cpp "
               f"{report.engine.get('llama_cpp_python')}: {report.prefix_tokens} prefix "
               f"tokens, {len(report.suffix_tokens)} suffix tokens, {s['greedy_steps']} greedy "
               f"tokens ({'same' if s['greedy_identical'] else 'differ'})")
    click.echo(f"{'pos':>4}  {'same':<4}  {'argmax g/f':<13} {'max|diff|':>9}  "
               "logits sha256 (graft)")
    for p in report.positions:
        click.echo(f"{p.index:>4}  {'yes' if p.identical else 'NO':<4}  "
                   f"{p.graft_argmax:>6}/{p.fresh_argmax:<6} {p.max_abs_diff:>9.3g}  "
                   f"{p.graft_sha256[:16]}")
    if report.recompute is not None:
        r = report.recompute
        state = "all match the manifest" if r["ok"] else f"{len(r['mismatches'])} differ"
        click.echo(f"recompute: {r['checked']} tensors, {state}")
    verdict = "BYTE-IDENTICAL" if report.byte_identical else "DIFFERENT"
    att = f", attestation #{report.attestation}" if report.attestation is not None else ""
    click.echo(f"result: {verdict}{att}")


def match(ctx: click.Context, spec: str, dtype: str | None, text: str,
          signed_by: tuple[str, ...], require_verified: bool, as_json: bool) -> None:
    from kvgraft.services.match import match as find

    _no_dtype(dtype)
    reg = current_registry(ctx)
    lm = _load(reg, spec, None)
    ids = lm.tokenize(text)
    found = find(reg, lm.identity, ids, require_signed_by=signed_by,
                 require_verified=require_verified)
    if as_json:
        emit_json({"query_tokens": len(ids), "match": found.to_json() if found else None})
        return
    if found is None:
        click.echo(f"no cached prefix for these {len(ids)} tokens")
        return
    names = ", ".join(found.references) or "untagged"
    click.echo(f"{found.digest}  {found.length} of {len(ids)} tokens cached "
               f"(artifact holds {found.token_count}; {names})")


def from_llama_state(ctx: click.Context, file: Path, model: str | None, flag: bool) -> Path:
    """The KV file converted from the seq-state file `file` (kept until the command ends)."""
    import shutil
    import tempfile

    if not flag or model is None or not is_gguf(model):
        raise UsageError("--from-llama-state and --model X.gguf go together")
    _integration()
    from kvgraft.integrations.llamacpp.statefile import kvfile_from_seq_file

    tmp = Path(tempfile.mkdtemp(prefix="kvgraft-llama-state-"))
    ctx.call_on_close(lambda: shutil.rmtree(tmp, ignore_errors=True))
    return kvfile_from_seq_file(file, model, tmp / "graft.kv",
                                cache_dir=current_registry(ctx).config.cache_dir)


def pull_llama_state(ctx: click.Context, ref: str, output: Path | None,
                     signed_by: tuple[str, ...], require_verified: bool, offline: bool,
                     as_json: bool) -> None:
    """`pull REF --llama-state -o FILE`: the verified KV file, written as a seq-state file."""
    import dataclasses
    import tempfile

    if output is None:
        raise UsageError("--llama-state writes a file: give --output")
    _integration()
    from kvgraft.client import check_output
    from kvgraft.integrations.llamacpp.statefile import seq_file_from_kvfile

    check_output(output)
    reg = current_registry(ctx)
    if offline and not reg.config.offline:
        reg = type(reg)(dataclasses.replace(reg.config, offline=True))
        ctx.call_on_close(reg.close)
    with tempfile.TemporaryDirectory(prefix="kvgraft-llama-state-") as tmp:
        kvfile = Path(tmp) / "graft.kv"
        result = reg.pull(Reference.parse(ref), kvfile, require_signed_by=signed_by,
                          require_verified=require_verified)
        seq_file_from_kvfile(kvfile, output)
    if as_json:
        emit_json({"digest": str(result.digest), "reference": ref, "output": str(output),
                   "format": "llama.cpp seq-state"})
        return
    err(f"pulled {ref} as a llama.cpp state file: {output}")
    click.echo(str(result.digest))

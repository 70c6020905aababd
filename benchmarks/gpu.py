"""Grafts on a GPU: byte-exactness on the device, restore throughput by stage, and the time
to the first token with a graft against without one.

    python -m benchmarks.gpu --out gpu.json [--tokens 8192,32768] [--device cuda]
        [--small] [--workers N] [--reps 3] [--workdir DIR] [--no-cli]

The model is random-init, built on the device from a config: Llama-3-8B's attention (32
layers, 32 heads, 8 KV heads of 128, bf16; 128 KiB of KV a token) with a small MLP and
vocabulary, so that the KV a graft restores is full size while no weights are carried.
Its prefill therefore costs less than Llama-3-8B's (no 14336-wide MLP): the TTFT without a
graft is an underestimate, which favours the prefill. `--small` takes the tests' tiny
Llama instead (for the CPU: `--device cpu --small --tokens 512`).

Everything runs against a registry in a temporary home (SQLite catalog, local store);
the figures are written to --out after every step, so a run cut short keeps what it had.
Per token count: capture and push; verify_graft with recompute (graft vs the fresh
two-step on the device: greedy tokens and logits bytes, and every tensor digest); the
stages of a restore (benchmarks/gpu_stages.py) next to the machine's ceilings; load_graft
end to end, cold and warm; TTFT. Once, at the smallest count, the command line in fresh
processes: capture on machine a, verify-graft --recompute and graft on machine b (its own
home and an empty cache, the catalog and store shared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SUFFIX_TOKENS = 16


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="write the figures here (JSON)")
    p.add_argument("--tokens", default="8192,32768", help="prefix lengths, comma-separated")
    p.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N")
    p.add_argument("--small", action="store_true", help="the tests' tiny Llama (for the CPU)")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads that read, decode and verify (default: every core)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    p.add_argument("--steps", type=int, default=8, help="greedy steps compared")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    p.add_argument("--no-cli", dest="cli", action="store_false",
                   help="skip the command-line check in fresh processes")
    args = p.parse_args(argv)
    args.sizes = [int(t) for t in args.tokens.split(",") if t]
    return args


def save(path: Path, results: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, path)


def environment(device: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    from kvgraft import __version__

    env = {"kvgraft": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "python": platform.python_version(),
           "host": platform.node(), "cpus": len(os.sched_getaffinity(0)),
           "device": str(device), "workers": args.workers, "torch_threads":
           torch.get_num_threads(), "model": "llama" if args.small else "llama3-8b-attention"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory=props.total_memory,
                   multiprocessors=props.multi_processor_count)
    return env


def tokens(n: int, seed: int) -> list[int]:
    """Byte ids (the tiny tokenizer's vocabulary), the same for a seed on every machine."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def build_model(root: Path, small: bool, device: Any) -> Path:
    from tests.support.tinymodels import build

    path = root / ("llama-bf16" if small else "llama3-8b-attention-bf16")
    if not (path / "config.json").is_file():
        build(path, "llama" if small else "llama3-8b-attention", dtype="BF16",
              device=str(device))
    return path


def one_size(reg: Any, registry_at: Callable[[str], Any], lm: Any, n: int,
             args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from benchmarks import gpu_stages
    from kvgraft.integrations.transformers import capture, verify_graft
    from kvgraft.transfer.push import PushOptions

    ids, suffix = tokens(n, n), tokens(SUFFIX_TOKENS, -n)
    ref = f"bench/gpu-{n}:v1"
    row: dict[str, Any] = {"tokens": n}
    kv, s = gpu_stages.timed(lambda: capture(lm, root / f"{n}.kv", token_ids=ids), lm.device)
    row["capture_s"] = round(s, 3)
    row["kv_bytes"] = kv.path.stat().st_size
    pushed, s = gpu_stages.timed(lambda: reg.push(
        kv.path, ref, options=PushOptions(workers=args.workers)))
    row["push_s"] = round(s, 3)
    kv.path.unlink()
    report, s = gpu_stages.timed(lambda: verify_graft(
        reg, lm, ref, suffix_ids=suffix, steps=args.steps, recompute=True), lm.device)
    row["fidelity"] = {**report.summary(), "recompute_ok": bool(report.recompute
                                                                and report.recompute["ok"]),
                       "tensors_checked": report.recompute["checked"] if report.recompute
                       else 0, "attestation": report.attestation, "seconds": round(s, 3),
                       "graft_tokens": list(report.graft_tokens),
                       "fresh_tokens": list(report.fresh_tokens)}
    row["stored_bytes"] = pushed.stored_size
    size = reg.open(ref).manifest.file_size
    row["stages"] = gpu_stages.stages(reg, lm, ref, args.workers, root)
    row["restore"] = gpu_stages.restore(registry_at, lm, ref, size, args.workers, args.reps)
    row["ttft"] = gpu_stages.ttft(registry_at, lm, ref, ids, suffix, args.workers, args.reps)
    return row


def cli_check(reg: Any, model: Path, device: Any, n: int, root: Path) -> dict[str, Any]:
    """The command line in fresh processes: a captures and pushes; b, with its own home
    and an empty cache over the same catalog and store, verifies (recomputing every
    tensor) and grafts."""
    text = "".join(chr(t) for t in tokens(n, n + 1))
    (root / "prefix.txt").write_text(text)
    (root / "prompt.txt").write_text(text + " And then")
    common = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    a = {**common, "KVGRAFT_HOME": str(reg.config.home), "KVGRAFT_CACHE": str(root / "cli-a")}
    b = {**common, "KVGRAFT_HOME": str(root / "home-b"), "KVGRAFT_CACHE": str(root / "cli-b"),
         "KVGRAFT_CATALOG_URL": reg.config.catalog_url, "KVGRAFT_BLOB_URL": reg.config.blob_url}
    model_args = ["--model", str(model), "--device", str(device), "--json"]
    out: dict[str, Any] = {"tokens": n}
    for name, env, args in [
        ("capture", a, ["capture", "bench/cli:v1", "--text-file", str(root / "prefix.txt")]),
        ("verify_graft", b, ["verify-graft", "bench/cli:v1", "--recompute", "--steps", "4"]),
        ("graft", b, ["graft", "bench/cli:v1", "--text-file", str(root / "prompt.txt"),
                      "--max-new-tokens", "4"]),
    ]:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "kvgraft.cli", *args, *model_args], env=env,
                           capture_output=True, text=True, timeout=300)
        step: dict[str, Any] = {"rc": p.returncode, "seconds": round(time.perf_counter() - t0, 2)}
        if p.returncode != 0:
            step["stderr"] = p.stderr[-2000:]
        else:
            got = json.loads(p.stdout)
            keep = {"capture": ["digest", "token_count"],
                    "verify_graft": ["byte_identical", "ok", "greedy_identical"],
                    "graft": ["reused_tokens", "computed_tokens", "generated"]}[name]
            step.update({k: got.get(k) for k in keep})
            if name == "verify_graft":
                step["recompute_ok"] = bool(got["recompute"] and got["recompute"]["ok"])
                step["device"] = got["engine"]["device"]
        out[name] = step
    out["ok"] = all(out[k]["rc"] == 0 for k in ("capture", "verify_graft", "graft")) and \
        bool(out["verify_graft"].get("ok")) and out["verify_graft"].get("recompute_ok", False)
    return out


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from benchmarks import gpu_stages
    from kvgraft.client import Registry
    from kvgraft.config import Config
    from kvgraft.integrations.transformers import load_model
    from kvgraft.integrations.transformers.device import resolve_device

    device = resolve_device(args.device)
    started = time.perf_counter()
    results: dict[str, Any] = {"env": environment(device, args), "sizes": []}

    def step(name: str, value: Any) -> None:
        results[name] = value
        results["seconds"] = round(time.perf_counter() - started, 1)
        save(args.out, results)

    step("ceilings", gpu_stages.ceilings(device, args.workers,
                                         (64 if args.small else 1024) << 20))

    def registry_at(cache: str) -> Any:
        return Registry(Config.from_env({"KVGRAFT_HOME": str(root / "home"),
                                         "KVGRAFT_CACHE": str(root / "caches" / cache)}))

    model, s = gpu_stages.timed(lambda: build_model(root, args.small, device), device)
    lm, s2 = gpu_stages.timed(lambda: load_model(model, cache_dir=root / "model-cache",
                                                 device=str(device)), device)
    step("model", {"dir_bytes": sum(f.stat().st_size for f in model.iterdir()),
                   "build_s": round(s, 2), "load_s": round(s2, 2),
                   "kv_bytes_per_token": _kv_per_token(lm.model.config)})
    reg = registry_at("main")
    try:
        for n in args.sizes:
            results["sizes"].append(one_size(reg, registry_at, lm, n, args, root))
            step("sizes", results["sizes"])
        if args.cli:
            step("cli", cli_check(reg, model, device, min(args.sizes), root))
    finally:
        reg.close()
    step("ok", all(r["fidelity"]["ok"] for r in results["sizes"])
         and results.get("cli", {"ok": True})["ok"])
    return results


def _kv_per_token(config: Any) -> int:
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(config.num_hidden_layers * heads * dim * 2 * 2)  # keys and values, bf16


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    args.out = args.out.absolute()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="kvgraft-gpu-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args, root.absolute())
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"ok": results["ok"], "seconds": results["seconds"],
                      "out": str(args.out)}))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

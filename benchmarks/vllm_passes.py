"""Does vLLM (CPU) compute the same KV for a prefix whatever the length of the forward pass
that computed it? The answer decides what a same-engine fidelity check can promise.

For each (prompt, prefix) pair, one engine (SmolLM2-135M-Instruct BF16, vLLM's own prefix
cache on, no connector) answers the prefix + a 3-token suffix twice, its prefix from the
prefix cache each time: once after computing the whole longer prompt (the prefix's KV
then comes from a pass of `prompt` tokens, as when a connector publishes the full chunks
of a longer prompt), once after computing the prefix alone (a pass of `prefix` tokens, as a
fresh recomputation of the graft does). The prefix cache is reset before each. Rows:
{"bench": "vllm-passes", "prompt": N, "prefix": P, "step": S (max_num_batched_tokens),
"tokens_equal" (8 greedy tokens), "logprobs_bit_equal" (top-20 of every step),
"max_abs_diff" (over those)}.

    python -m benchmarks.vllm_passes [--pairs 1100:1024,1600:1536,2100:2048,2916:2816]
                                     [--step 4096] [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PAIRS = ((1100, 1024), (1600, 1536), (2100, 2048), (2916, 2816))
SUFFIX = [28, 2103, 30]  # a few tokens the prefix is not followed by in the document


def _run(model: Path, tokens: list[int], pairs: list[tuple[int, int]], step: int,
         ) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=8192, enforce_eager=True, max_num_seqs=1, seed=0,
              enable_prefix_caching=True, max_num_batched_tokens=step)
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, logprobs=20)

    def answer(ids: list[int]) -> tuple[list[int], list[dict[int, float]], int]:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        c = out.outputs[0]
        steps = [{k: v.logprob for k, v in s.items()} for s in c.logprobs or []]
        return list(c.token_ids), steps, int(out.num_cached_tokens or 0)

    rows = []
    for total, plen in pairs:
        prompt, prefix = tokens[:total], tokens[:plen]
        runs = []
        for warm in (prompt, prefix):
            llm.reset_prefix_cache()
            answer(warm)  # the prefix's KV, computed in a pass of len(warm) tokens
            runs.append(answer(prefix + SUFFIX))
        (ta, la, ca), (tb, lb, cb) = runs
        diffs = [abs(a[k] - b[k]) for a, b in zip(la, lb, strict=True) for k in a.keys() & b.keys()]
        rows.append({"bench": "vllm-passes", "prompt": total, "prefix": plen, "step": step,
                     "cached": [ca, cb], "tokens_equal": ta == tb,
                     "logprobs_bit_equal": la == lb, "max_abs_diff": max(diffs, default=0.0)})
    return rows


def run(report: Callable[[dict[str, Any]], None], workdir: Path = Path(".bench")) -> None:
    """The rows, from a process of its own (vLLM logs to stdout and spawns processes)."""
    out = workdir.absolute() / "vllm-passes.json"
    out.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vllm_passes", "--workdir",
                           str(workdir), "--out", str(out)], capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0 or not out.exists():
        report({"bench": "vllm-passes", "failed": proc.stderr[-2000:]})
        return
    for row in json.loads(out.read_text()):
        report(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(f"{a}:{b}" for a, b in PAIRS))
    parser.add_argument("--step", type=int, default=4096)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    parser.add_argument("--out", type=Path, help="write the rows there as one JSON list")
    args = parser.parse_args()
    pairs = [(int(a), int(b)) for a, b in (p.split(":") for p in args.pairs.split(","))]
    try:
        import vllm  # noqa: F401

        from kvgraft.integrations.transformers.models import smollm2_dir
    except ImportError:
        rows: list[dict[str, Any]] = [{"bench": "vllm-passes",
                                       "skipped": "needs the [vllm] and [hf] extras"}]
    else:
        from transformers import AutoTokenizer

        from benchmarks.graft import document_tokens

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        model = smollm2_dir(args.workdir / "model-cache")
        tokens = document_tokens(AutoTokenizer.from_pretrained(model),
                                 max(a for a, _ in pairs))
        rows = _run(model, tokens, pairs, args.step)
    if args.out:
        args.out.write_text(json.dumps(rows))
    else:  # vLLM's own log lines share stdout: one row per line, after them
        for row in rows:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":  # vLLM spawns processes
    main()

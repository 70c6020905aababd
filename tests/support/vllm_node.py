"""One vLLM engine with the kvgraft connector, run as its own process (a "node"): it
generates greedily for each prompt in order and prints one JSON line with the results.

    python -m tests.support.vllm_node SPEC_JSON
    python -m tests.support.vllm_node @SPEC_FILE  (a spec too long for the command line)

SPEC: {"model": dir, "env": {KVGRAFT_*: ...}, "prompts": [[ids], ...], "max_tokens": n,
"extra": {kv_connector_extra_config}, "role": "kv_both", "prefix_caching": true,
"loras": {name: adapter dir}, "max_model_len": n, "throttle": {"host", "port", "latency",
"bytes_per_s"}, "inproc": false}. A prompt is a list of ids, or {"ids": [...], "lora": name,
"salt": cache_salt} with, for tests/test_vllm_restore_pays.py, "rate" (the throttle's bytes/s
from this request on), "cold" (the machine cache emptied first), "fresh_store" (the store's
speed forgotten: the next restore measures it again) and "free_prefill" (the engine's prefill
estimated to cost nothing from this request on).

"throttle": the node reaches the S3 store through tests/support/throttle.py's proxy, run as
a process of its own (KVGRAFT_S3_ENDPOINT_URL is its address). "inproc": vLLM's engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and each result also has the scheduler
side's counters after it ("counters"), the connector's estimates ("cost") and the seconds
the request took ("seconds": max_tokens=1 makes it the time to first token); the "rate",
"cold", "fresh_store" and "free_prefill" options need it. vLLM spawns processes: the
__main__ guard is required.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    os.environ.update(spec.get("env", {}))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    link = None
    if spec.get("throttle"):
        t = spec["throttle"]
        link = subprocess.Popen(
            [sys.executable, "-m", "tests.support.throttle", t["host"], str(t["port"]),
             str(t["bytes_per_s"]), str(t.get("latency", 0.0))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert link.stdout is not None
        os.environ["KVGRAFT_S3_ENDPOINT_URL"] = link.stdout.readline().strip()
    if spec.get("inproc"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = KVTransferConfig(kv_connector="KvgraftConnector",
                           kv_connector_module_path="kvgraft.integrations.vllm",
                           kv_role=spec.get("role", "kv_both"),
                           kv_connector_extra_config=spec.get("extra", {}))
    from vllm.lora.request import LoRARequest

    loras = {name: LoRARequest(name, i, path)
             for i, (name, path) in enumerate(sorted(spec.get("loras", {}).items()), start=1)}
    lora_options: dict[str, Any] = ({"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
                                    if loras else {})
    parallel: dict[str, Any] = {}
    tp, pp = spec.get("tensor_parallel", 1), spec.get("pipeline_parallel", 1)
    if tp * pp > 1:  # a worker process per rank, each on a core
        parallel = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                    "distributed_executor_backend": "mp"}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=spec.get("max_model_len", 1024),
              enforce_eager=spec.get("eager", True),
              kv_transfer_config=ktc, max_num_seqs=2, seed=0,
              enable_prefix_caching=spec.get("prefix_caching", True), **lora_options,
              **parallel)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0,
                            detokenize=False, logprobs=0)
    connector = (llm.llm_engine.engine_core.engine_core.scheduler.connector  # type: ignore[attr-defined]
                 if spec.get("inproc") else None)
    results = []
    for item in spec["prompts"]:
        item = item if isinstance(item, dict) else {"ids": item}
        if connector is not None:
            prepare(connector, link, item)
        prompt = TokensPrompt(prompt_token_ids=item["ids"])
        if item.get("salt"):
            prompt["cache_salt"] = item["salt"]
        lora = loras[item["lora"]] if item.get("lora") else None
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        seconds = time.perf_counter() - t0
        comp = out.outputs[0]
        logprobs = []
        for step, tok in zip(comp.logprobs or [], comp.token_ids, strict=True):
            assert step is not None  # logprobs=0 asks for the sampled token's at every step
            logprobs.append(step[tok].logprob)
        result = {"tokens": list(comp.token_ids), "logprobs": logprobs,
                  "cached": int(out.num_cached_tokens or 0), "seconds": seconds}
        if connector is not None:
            cost = connector._ctx.cost
            result["counters"] = connector.counters.snapshot()
            result["cost"] = {"store_bytes_per_s": cost.store.bytes_per_s,
                              "store_latency": cost.store.latency,
                              "prefill_tokens_per_s": cost.prefill.tokens_per_s}
        results.append(result)
    if link is not None:
        assert link.stdin is not None
        link.stdin.close()
        link.wait(10)
    return results


def prepare(connector: Any, link: Any, item: dict[str, Any]) -> None:
    """The options of a request that change the node before it (engine core in process)."""
    from kvgraft.integrations.restorecost import StoreSpeed

    ctx = connector._ctx
    if item.get("rate") is not None:
        assert link is not None and link.stdin and link.stdout, "a rate needs the throttle"
        link.stdin.write(f"{float(item['rate'])}\n")
        link.stdin.flush()
        assert link.stdout.readline().strip() == "ok"
    if item.get("cold"):
        ctx.registry.cache.prune(everything=True)
    if item.get("fresh_store"):
        ctx.cost.store = StoreSpeed()
    if item.get("free_prefill"):
        ctx.cost.prefill.seconds = lambda tokens: 0.0
    elif item.get("free_prefill") is False:
        vars(ctx.cost.prefill).pop("seconds", None)


if __name__ == "__main__":
    arg = sys.argv[1]
    if arg.startswith("@"):
        with open(arg[1:]) as f:
            arg = f.read()
    spec = json.loads(arg)
    print("KVGRAFT-RESULT " + json.dumps(run(spec)), flush=True)

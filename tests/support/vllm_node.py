"""One vLLM engine with the kvgraft connector, run as its own process (a "node"): it
generates greedily for each prompt in order and prints one JSON line with the results.

    python -m tests.support.vllm_node SPEC_JSON

SPEC: {"model": dir, "env": {KVGRAFT_*: ...}, "prompts": [[ids], ...], "max_tokens": n,
"extra": {kv_connector_extra_config}, "role": "kv_both", "prefix_caching": true,
"loras": {name: adapter dir}}. A prompt is a list of ids, or {"ids": [...], "lora": name,
"salt": cache_salt}. vLLM spawns processes: the __main__ guard is required.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    os.environ.update(spec.get("env", {}))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=spec.get("max_model_len", 1024), enforce_eager=True,
              kv_transfer_config=ktc, max_num_seqs=2, seed=0,
              enable_prefix_caching=spec.get("prefix_caching", True), **lora_options)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0,
                            detokenize=False, logprobs=0)
    results = []
    for item in spec["prompts"]:
        item = item if isinstance(item, dict) else {"ids": item}
        prompt = TokensPrompt(prompt_token_ids=item["ids"])
        if item.get("salt"):
            prompt["cache_salt"] = item["salt"]
        lora = loras[item["lora"]] if item.get("lora") else None
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        comp = out.outputs[0]
        logprobs = []
        for step, tok in zip(comp.logprobs or [], comp.token_ids, strict=True):
            assert step is not None  # logprobs=0 asks for the sampled token's at every step
            logprobs.append(step[tok].logprob)
        results.append({"tokens": list(comp.token_ids), "logprobs": logprobs,
                        "cached": int(out.num_cached_tokens or 0)})
    return results


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print("KVGRAFT-RESULT " + json.dumps(run(spec)), flush=True)

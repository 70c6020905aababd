"""Cross-engine fidelity of SmolLM2-135M-Instruct: llama.cpp running the Q4_1 GGUF, and
transformers running the same GGUF dequantised (F32). Each engine's KV of one prefix is
restored into the other engine, and what that engine then computes is compared with what
it computes from its own prefill: argmax agreement and KL, never byte-exactness.

llama.cpp's GGUF converter permutes the rows of each head's query and key projections so
that llama.cpp can rotate adjacent pairs of dimensions (its "normal" RoPE), where
transformers rotates the two halves of a head (`rotate_half`); transformers' GGUF loader
undoes the permutation. So llama.cpp's keys hold, for each head, transformers' dimension i
at 2i and dimension i + head_dim/2 at 2i + 1, and a key moved between the two engines
must be permuted on the way (values are not rotated, so not permuted). The rows without
the permutation show what a restore that skipped it would compute.

Teacher-forced: both sides of each comparison are fed the same tokens (the question, then
the receiving engine's own greedy continuation), so every row compares the same position.
`run(report)` calls `report(row)` once per comparison:
  {"bench": "cross_engine", "tokens": N, "kv": "llama.cpp", "into": "transformers",
   "permuted": true, "rows": R, "argmax_agreement": a, "max_kl": k, "mean_kl": m,
   "key_max_abs_diff": d}
`key_max_abs_diff` (and `value_max_abs_diff`) compare the two engines' KV of the prefix.

    python -m benchmarks.cross_engine [--tokens 512] [--steps 16] [--workdir .bench]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.llamacpp import DOC, QUESTION, gguf_path


def llama_keys_to_hf(k: Any) -> Any:
    """[heads, T, head_dim] keys of llama.cpp's layout in transformers' layout."""
    return np.concatenate([k[..., 0::2], k[..., 1::2]], axis=-1)


def hf_keys_to_llama(k: Any) -> Any:
    out = np.empty_like(k)
    half = k.shape[-1] // 2
    out[..., 0::2], out[..., 1::2] = k[..., :half], k[..., half:]
    return out


def _rows_stats(got: Sequence[Any], want: Sequence[Any]) -> dict[str, Any]:
    from kvgraft.integrations.fidelity import compare_rows

    pos = compare_rows("teacher", 0, np.stack(got), np.stack(want))
    kls = [p.kl for p in pos]
    return {"rows": len(pos),
            "argmax_agreement": sum(p.graft_argmax == p.fresh_argmax for p in pos) / len(pos),
            "max_kl": max(kls), "mean_kl": sum(kls) / len(kls)}


def run(report: Callable[[dict[str, Any]], None], workdir: Path, *, tokens: int = 512,
        steps: int = 16) -> None:
    import torch
    from transformers import DynamicCache

    from kvgraft.integrations.llamacpp import Settings
    from kvgraft.integrations.llamacpp import load_model as load_gguf
    from kvgraft.integrations.llamacpp.engine import last_logits, set_seq_state
    from kvgraft.integrations.llamacpp.graft import greedy as llama_greedy
    from kvgraft.integrations.llamacpp.graft import prefill as llama_prefill
    from kvgraft.integrations.llamacpp.graft import state_tensors
    from kvgraft.integrations.llamacpp.state import LayerKV, api_header, build_seq_state
    from kvgraft.integrations.transformers.capture import cache_tensors
    from kvgraft.integrations.transformers.capture import prefill as hf_prefill
    from kvgraft.integrations.transformers.generate import forward
    from kvgraft.integrations.transformers.generate import greedy as hf_greedy
    from kvgraft.integrations.transformers.models import load_model as load_hf

    torch.set_num_threads(2)
    cache_dir = workdir / "cache"
    llama = load_gguf(gguf_path(), cache_dir=cache_dir, settings=Settings(threads=2))
    hf = load_hf("smollm2", cache_dir=cache_dir, dtype="F32")
    ids = llama.tokenize(DOC.read_text(encoding="utf-8"))[:tokens]
    question = llama.tokenize(QUESTION, special=False)

    # each engine's own prefill, its KV, and its greedy continuation from its own KV
    llama_prefill(llama, ids)
    llama_kv = [(layer.key.view(np.float16).astype(np.float32),
                 layer.value.view(np.float16).astype(np.float32))
                for layer in state_tensors(llama, len(ids))]
    hf_cache, _ = hf_prefill(hf, ids)
    hf_kv = [(k.numpy().copy(), v.numpy().copy()) for k, v, _ in cache_tensors(hf_cache, len(ids))]

    def llama_feed(restore: Callable[[], None], feed: Sequence[int]) -> list[Any]:
        restore()
        rows = []
        llama.llm.eval(list(question))
        rows.append(last_logits(llama))
        for t in feed:
            llama.llm.eval([t])
            rows.append(last_logits(llama))
        return rows

    def hf_feed(cache: Any, feed: Sequence[int]) -> list[Any]:
        logits = forward(hf, cache, [*question, *feed])
        return list(logits[len(question) - 1:].float().numpy())

    def hf_cache_of(kv: Sequence[tuple[Any, Any]]) -> Any:
        cache = DynamicCache(config=hf.model.config)
        layers: list[Any] = list(cache.layers)  # SmolLM2: full attention, DynamicLayer
        for layer, (k, v) in zip(layers, kv, strict=True):
            kt, vt = torch.from_numpy(k)[None], torch.from_numpy(v)[None]
            layer.lazy_initialization(kt, vt)
            layer.keys, layer.values = kt, vt
        return cache

    def llama_state_of(kv: Sequence[tuple[Any, Any]]) -> Callable[[], None]:
        layers = [LayerKV(k.astype(np.float16).view(np.uint16),
                          v.astype(np.float16).view(np.uint16), "F16") for k, v in kv]

        def restore() -> None:
            state = build_seq_state(layers, len(ids), llama.v_trans, prefix=api_header())
            set_seq_state(llama, bytearray(state), list(ids))
        return restore

    # the continuations every comparison feeds: each receiving engine's own greedy tokens
    hf_tokens = [st.token for st in hf_greedy(hf, hf_cache_of(hf_kv), question, steps - 1)]
    hf_ref = hf_feed(hf_cache_of(hf_kv), hf_tokens[:-1])
    llama_prefill(llama, ids)
    llama_tokens = [t for _, t in llama_greedy(llama, question, steps - 1)]
    llama_ref = llama_feed(lambda: llama_prefill(llama, ids), llama_tokens[:-1])

    base = {"bench": "cross_engine", "tokens": len(ids), "steps": steps,
            "key_max_abs_diff": max(float(np.abs(llama_keys_to_hf(a[0]) - b[0]).max())
                                    for a, b in zip(llama_kv, hf_kv, strict=True)),
            "key_max_abs_diff_unpermuted": max(float(np.abs(a[0] - b[0]).max())
                                               for a, b in zip(llama_kv, hf_kv, strict=True)),
            "value_max_abs_diff": max(float(np.abs(a[1] - b[1]).max())
                                      for a, b in zip(llama_kv, hf_kv, strict=True)),
            "key_max_abs": max(float(np.abs(b[0]).max()) for b in hf_kv)}
    # the engines themselves, each from its own prefill, fed the same tokens
    report({**base, "kv": "own", "into": "llama.cpp vs transformers", "permuted": None,
            **_rows_stats(llama_feed(lambda: llama_prefill(llama, ids), hf_tokens[:-1]),
                          hf_ref)})
    for permuted in (True, False):
        moved = [(llama_keys_to_hf(k) if permuted else k, v) for k, v in llama_kv]
        report({**base, "kv": "llama.cpp", "into": "transformers", "permuted": permuted,
                **_rows_stats(hf_feed(hf_cache_of(moved), hf_tokens[:-1]), hf_ref)})
        back = [(hf_keys_to_llama(k) if permuted else k, v) for k, v in hf_kv]
        report({**base, "kv": "transformers", "into": "llama.cpp", "permuted": permuted,
                **_rows_stats(llama_feed(llama_state_of(back), llama_tokens[:-1]),
                              llama_ref)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    args = parser.parse_args()
    run(lambda row: print(json.dumps(row), flush=True), args.workdir, tokens=args.tokens,
        steps=args.steps)


if __name__ == "__main__":
    main()

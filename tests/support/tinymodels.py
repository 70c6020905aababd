"""Small random-init transformer models built offline from configs (seeded), saved as
model directories with a byte-level tokenizer, for tests that need real models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 260  # 256 byte symbols + specials + spare ids
WINDOW = 16  # sliding window of the Gemma models: small, so tests cross it


def byte_tokenizer(*, rotate: int = 0) -> Any:
    """A byte-level BPE tokenizer with no merges. `rotate` shifts every byte's id, giving a
    different tokenizer of the same size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: (i + rotate) % 256 for i, ch in enumerate(alphabet)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # transformers leaves the tokenizer's constructor unannotated.
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def config(kind: str, **overrides: Any) -> Any:
    common: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 4096, "bos_token_id": 256, "eos_token_id": 257,
        "pad_token_id": 258, "tie_word_embeddings": True,
    }
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**{**common, "num_hidden_layers": 2, **overrides})
    if kind == "llama3-8b-attention":
        # Llama-3-8B's attention and KV shape (its KV is 128 KiB a token in bf16) with a
        # small MLP and vocabulary: what a graft restores is full size, the weights are not.
        from transformers import LlamaConfig

        return LlamaConfig(**{**common, "hidden_size": 4096, "intermediate_size": 1024,
                              "num_hidden_layers": 32, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "head_dim": 128,
                              "max_position_embeddings": 65536, "rope_theta": 500000.0,
                              "tie_word_embeddings": False, **overrides})
    if kind == "gemma2":
        from transformers import Gemma2Config

        return Gemma2Config(**{**common, "num_hidden_layers": 3, "sliding_window": WINDOW,
                               "query_pre_attn_scalar": 16, **overrides})
    if kind == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**{**common, "num_hidden_layers": 4, "sliding_window": WINDOW,
                                   "query_pre_attn_scalar": 16,
                                   "layer_types": ["sliding_attention", "sliding_attention",
                                                   "sliding_attention", "full_attention"],
                                   **overrides})
    raise ValueError(kind)


def build(path: Path, kind: str, *, dtype: str = "F32", seed: int = 0, rotate: int = 0,
          device: str = "cpu", **overrides: Any) -> Path:
    """Write a random-init model directory (same kind, seed and overrides: same weights on
    one device; `device` is where the weights are drawn, which is fast on a GPU for the
    large kinds, and other devices draw other numbers)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = config(kind, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    model = model.to({"F32": torch.float32, "BF16": torch.bfloat16}[dtype]).eval()
    model.save_pretrained(path)
    byte_tokenizer(rotate=rotate).save_pretrained(path)
    return path

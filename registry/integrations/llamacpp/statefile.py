"""llama.cpp seq-state files in and out: the files `llama_state_seq_save_file` and
llama-server's slot save (`/slots/{id}?action=save`) write, as KV files and back. A slot
file's token list may be llama-server's packed one (state.read_seq_file); a graft imported
from one is written back the same way.

In: the file's state is converted to a KV file whose identity is the GGUF's with this
llama.cpp's engine part, the flash-attention setting read from the file's V layout and the
KV type from its layers (the file says nothing about the build that wrote it: it is taken
to be this one). Out: a llama.cpp graft's KV file becomes a seq-state file of the version
this llama.cpp reads (`llama_state_seq_load_file`, slot restore).
"""

from __future__ import annotations

import mmap
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from kvgraft.digest import Digest
from kvgraft.errors import UsageError
from kvgraft.formats.kvfile import read_layout
from kvgraft.integrations.llamacpp import gguf
from kvgraft.integrations.llamacpp.engine import Settings, engine_fingerprint
from kvgraft.integrations.llamacpp.state import (
    GGML_IDS,
    KV_TYPES,
    LayerKV,
    Shape,
    build_seq_state,
    kv_tensors,
    parse_seq_state,
    read_seq_file,
    write_seq_file,
)


def kvfile_from_seq_file(path: Path | str, model: Path | str, output: Path | str, *,
                         cache_dir: Path | None) -> Path:
    """Convert the seq-state file `path`, written by llama.cpp running the GGUF `model`,
    into the KV file `output`."""
    tokens, body, packed = read_seq_file(path)
    config = gguf.arch_config(gguf.read_gguf(model), "F16")
    shape = Shape(int(config["num_hidden_layers"]), int(config["num_key_value_heads"]),
                  int(config["head_dim"]), int(config["v_head_dim"]))
    count, v_trans, layers = parse_seq_state(body, shape)
    if count != len(tokens):
        raise UsageError(f"{path}: {len(tokens)} tokens but {count} KV cells")
    kind = GGML_IDS[layers[0].dtype]
    settings = Settings(flash_attn=not v_trans, type_k=kind, type_v=kind)
    fp, _ = engine_fingerprint(model, settings, cache_dir=cache_dir)
    from kvgraft.integrations.llamacpp.graft import write_graft

    source = Digest.of(Path(path).read_bytes())
    return write_graft(fp, tokens, kv_tensors(layers), output, created=datetime.now(UTC),
                       input_extra={"llama_state_file": str(source),
                                    "llama_state_tokens": "packed" if packed else "plain"})


def seq_file_from_kvfile(kvfile: Path | str, output: Path | str) -> Path:
    """Write the llama.cpp graft in `kvfile` as a seq-state file llama.cpp loads."""
    layout = read_layout(kvfile)
    engine = layout.model_config.get("engine")
    if not isinstance(engine, dict) or engine.get("name") != "llama.cpp":
        raise UsageError("not a llama.cpp graft: only grafts captured on llama.cpp can be "
                         "written as llama.cpp state files")
    with open(kvfile, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        layers = []
        for li in layout.layers:
            arrays = []
            for t in (li.key, li.value):
                kind = next(np_type for name, np_type in KV_TYPES.values() if name == t.dtype)
                flat = np.frombuffer(buf, dtype=kind, count=t.nbytes // t.itemsize,
                                     offset=t.begin)
                arrays.append(flat.reshape(t.shape))
            layers.append(LayerKV(arrays[0], arrays[1], li.key.dtype))
        tokens = [int(x) for x in np.frombuffer(buf, dtype="<i8", count=layout.token_count,
                                                offset=layout.token_ids.begin)]
        state = build_seq_state(layers, layout.token_count, bool(engine.get("v_trans")))
        del layers, arrays, flat  # views of the mapping: gone before it closes
    # a slot file llama-server saved goes back with its packed token list: byte for byte
    source = layout.provenance.get("input", {})
    packed = isinstance(source, dict) and source.get("llama_state_tokens") == "packed"
    return write_seq_file(output, tokens, state, packed=packed)

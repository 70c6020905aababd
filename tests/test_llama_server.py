"""llama.cpp's own llama-server, a slot saved on one machine and restored on another through
kvgraft, with the SmolLM2 GGUF.

llama-server is built from the llama.cpp that the installed llama-cpp-python vendors
(tests/support/llama_server.py: once per version, cached under .services/). Server A
computes a document and saves its slot (`/slots/0?action=save`); machine A pushes the file
with `push --from-llama-state`; machine B, with its own home and cache on the same catalog
and store, pulls it with `pull --llama-state` into server B's slot directory; server B
restores it (`?action=restore`) and completes without computing the document again, with
the same tokens and the same probabilities as A; llama-cpp-python grafts it on B and
generates what A did. A state file of another model and a truncated one are refused.

This llama-server writes its slot's tokens as a packed list (LLAMA_TOKEN_NULL, a format
version, the count, the tokens, then the slot's media chunks), where the seq-state file
format has plain token ids; it reads both, and so does kvgraft: the slot file as saved is
pushed, and pulled back byte for byte (packed again); the same state with a plain token
list (what older servers wrote) round-trips as plain. A packed list of another version, or
one that names media chunks, is refused.

Without a C++ toolchain or the sdist the module skips, except under CI=true, where that and
any failure to build fail.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvgraft.catalog import Catalog
from kvgraft.client import Registry
from kvgraft.config import Config
from tests.support.harness import unavailable
from tests.test_llamacpp import DOC, QUESTION, kv, machine, ok_json, smollm2_gguf

pytestmark = pytest.mark.slow

REF = "docs/server-slot:v1"
SLOT_FILE = "slot.bin"
# How both servers run: what kvgraft's llama.cpp engine identity assumes when it imports
# a state file (f16 K and V, flash attention off so V is stored transposed, weights not
# repacked for the CPU's extra kernels: the AMX ones crash on this model), the binding's
# batch sizes, and 2 threads. No prompt cache in RAM, so B's prefix can only come from the
# restored slot; no warm-up decode, which only costs time here. Log level 4 prints the
# build's CPU features and the buffers the model and the KV cache got.
SERVER_ARGS = ["-np", "1", "-c", "4096", "-t", "2", "-tb", "2", "-b", "512", "-ub", "512",
               "-fa", "off", "-ctk", "f16", "-ctv", "f16", "--no-repack", "--cache-ram", "0",
               "--no-warmup", "--no-webui", "-lv", "4"]

SEQ_HEADER = struct.Struct("<III")  # magic "ggsq", format version, token count
NULL_TOKEN = -1  # LLAMA_TOKEN_NULL: marks llama-server's packed token list
PACKED_VERSION = 1  # of that list, in this llama-server


def completion(prompt: str) -> dict[str, Any]:
    # Greedy, with the top probabilities of each step: the logits' softmax, printed exactly,
    # so equal numbers check the logits and not only which token is the largest.
    return {"prompt": prompt, "n_predict": 8, "temperature": 0, "cache_prompt": True,
            "id_slot": 0, "return_tokens": True, "n_probs": 4}


def slot_tokens(path: Path) -> tuple[list[int], int]:
    """(the slot's token ids, where the state starts) of a file llama-server saved: its
    token list is [NULL, version, count, ids..., media count]."""
    data = path.read_bytes()
    _, _, n = SEQ_HEADER.unpack_from(data)
    words = np.frombuffer(data, dtype="<i4", count=n, offset=SEQ_HEADER.size)
    count = int(words[2])
    assert (int(words[0]), int(words[1])) == (NULL_TOKEN, PACKED_VERSION), words[:3]
    assert n == count + 4 and int(words[-1]) == 0, "not a text-only packed token list"
    return [int(t) for t in words[3:3 + count]], SEQ_HEADER.size + 4 * n


def with_plain_tokens(path: Path, out: Path) -> Path:
    """`path` with its packed token list written as plain ids, the state bytes unchanged."""
    data = path.read_bytes()
    magic, version, _ = SEQ_HEADER.unpack_from(data)
    tokens, state = slot_tokens(path)
    out.write_bytes(SEQ_HEADER.pack(magic, version, len(tokens))
                    + np.asarray(tokens, dtype="<i4").tobytes() + data[state:])
    return out


@pytest.fixture(scope="module")
def server_binary() -> Path:
    from tests.support.llama_server import (
        BuildFailed,
        SourcesUnavailable,
        ToolchainMissing,
        ensure_llama_server,
    )

    try:
        built = ensure_llama_server()
    except ToolchainMissing as e:
        unavailable(f"a toolchain to build llama-server ({e})")
        raise
    except SourcesUnavailable as e:
        unavailable(f"the llama.cpp sources of llama-cpp-python ({e})")
        raise
    except BuildFailed as e:
        pytest.fail(f"llama-server did not build: {e}")
    how = "found built" if built.cached else "built"
    print(f"\nllama-server {built.version}: {how} ({built.seconds:.0f} s to build): "
          f"{built.binary}")
    return built.binary


@pytest.fixture(scope="module")
def model() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def world(server_binary: Path, model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Server A's run: the document computed, the slot saved, then a question after it;
    and the two machines' environments on one catalog and store."""
    from tests.support.llama_server import start_llama_server

    root = tmp_path_factory.mktemp("llama-server")
    url = f"sqlite:///{root / 'catalog.db'}"
    Catalog.open(url, auto_upgrade=True).close()
    shared = {"KVGRAFT_CATALOG_URL": url, "KVGRAFT_BLOB_URL": (root / "store").as_uri()}
    slots = root / "slots-a"
    slots.mkdir()
    server = start_llama_server(server_binary, model, root / "server-a.log",
                                args=[*SERVER_ARGS, "--slot-save-path", str(slots)])
    try:
        t0 = time.perf_counter()
        first = server.post("/completion", completion(DOC))
        compute_s = time.perf_counter() - t0
        saved = server.post("/slots/0?action=save", {"filename": SLOT_FILE})
        # the question after the saved document: the document from the slot, the question
        # computed, as B will after its restore
        question = server.post("/completion", completion(DOC + QUESTION))
    finally:
        server.stop()
    return {"root": root, "model": model, "binary": server_binary, "slot": slots / SLOT_FILE,
            "plain": with_plain_tokens(slots / SLOT_FILE, root / "plain.bin"),
            "first": first, "saved": saved, "question": question, "compute_s": compute_s,
            "log": (root / "server-a.log").read_text(errors="replace"),
            "a": machine(shared, root / "a"), "b": machine(shared, root / "b")}


def test_server_computes_and_saves_the_document(world: dict[str, Any]) -> None:
    first, saved = world["first"], world["saved"]
    n = first["tokens_evaluated"]
    assert 300 <= n <= 600
    assert first["timings"]["prompt_n"] == n and first["timings"]["cache_n"] == 0
    assert len(first["tokens"]) == first["tokens_predicted"] > 0
    # the slot: the document and the generated tokens but the last (sampled, never fed)
    assert saved["n_saved"] == n + len(first["tokens"]) - 1
    assert saved["n_written"] == world["slot"].stat().st_size
    tokens, _ = slot_tokens(world["slot"])
    assert len(tokens) == saved["n_saved"] and tokens[n:] == first["tokens"][:-1]
    # the question reused the document from the slot and computed only its own tokens
    question = world["question"]["timings"]
    assert question["cache_n"] >= n and question["prompt_n"] < 20
    print(f"\nserver A: {n}-token document computed in {world['compute_s']:.2f} s, slot "
          f"of {saved['n_saved']} tokens saved ({saved['n_written']} bytes)")


def test_server_runs_as_the_identity_says(world: dict[str, Any]) -> None:
    """The imported file is taken to be written by this llama.cpp with the binding's
    defaults: the server's CPU features and backends (its system_info line) are the
    binding's, flash attention is off, K and V are f16, and the weights are not repacked
    (one plain CPU buffer, no CPU_REPACK or AMX one)."""
    from kvgraft.integrations.llamacpp.engine import system_info

    log = world["log"]
    assert system_info() in log, log[-3000:]
    assert re.search(r"flash_attn\s+= disabled", log)
    assert re.search(r"K \(f16\).*V \(f16\)", log)
    buffers = re.findall(r"(\S+) model buffer size", log)
    assert buffers == ["CPU_Mapped"], buffers


@pytest.fixture(scope="module")
def pushed(world: dict[str, Any]) -> dict[str, Any]:
    """The slot file as the server saved it, pushed from machine A."""
    t0 = time.perf_counter()
    out = ok_json(kv(world["a"], "push", "--from-llama-state", str(world["slot"]), REF,
                     "--model", str(world["model"]), "--json"))
    return {**out, "seconds": time.perf_counter() - t0}


def test_slot_restored_on_another_machine(world: dict[str, Any], pushed: dict[str, Any],
                                          ) -> None:
    from tests.support.llama_server import start_llama_server

    root, model, b = world["root"], world["model"], world["b"]
    assert pushed["token_count"] == world["saved"]["n_saved"]
    # the graft has the identity of this model on the binding's default engine settings,
    # so the binding's own graft, check and match find and accept it
    fp = ok_json(kv(b, "fingerprint", "--model", str(model), "--json"))
    reg = Registry(Config.from_env(b))
    assert str(reg.manifest(reg.resolve(REF)).model.key) == fp["key"]

    slots = root / "slots-b"
    slots.mkdir()
    t0 = time.perf_counter()
    ok_json(kv(b, "pull", REF, "--llama-state", "-o", str(slots / SLOT_FILE), "--json"))
    pull_s = time.perf_counter() - t0
    assert (slots / SLOT_FILE).read_bytes() == world["slot"].read_bytes()

    server = start_llama_server(world["binary"], model, root / "server-b.log",
                                args=[*SERVER_ARGS, "--slot-save-path", str(slots)])
    try:
        restored = server.post("/slots/0?action=restore", {"filename": SLOT_FILE})
        assert restored["n_restored"] == world["saved"]["n_saved"]
        t0 = time.perf_counter()
        again = server.post("/completion", completion(DOC))
        restore_s = time.perf_counter() - t0
        # restored again: the question then starts from A's saved state exactly
        server.post("/slots/0?action=restore", {"filename": SLOT_FILE})
        question = server.post("/completion", completion(DOC + QUESTION))
    finally:
        server.stop()
    first = world["first"]
    n = first["tokens_evaluated"]
    # the same document: all of it from the slot but its last token, which llama-server
    # evaluates again for the logits of the first generated token
    assert again["tokens_evaluated"] == n
    assert again["timings"]["cache_n"] == n - 1 and again["timings"]["prompt_n"] == 1
    assert again["tokens"] == first["tokens"] and again["content"] == first["content"]
    # the question: the document from the slot, the same tokens computed as on A, and the
    # same generation with the same probabilities, step by step
    mine, theirs = question, world["question"]
    assert mine["timings"]["cache_n"] == theirs["timings"]["cache_n"]
    assert mine["timings"]["prompt_n"] == theirs["timings"]["prompt_n"]
    assert mine["tokens"] == theirs["tokens"] and mine["content"] == theirs["content"]
    assert mine["completion_probabilities"] == theirs["completion_probabilities"]
    print(f"\npush {pushed['seconds']:.2f} s, pull {pull_s:.2f} s; B: the {n}-token document from "
          f"the slot in {restore_s:.2f} s (A computed it in {world['compute_s']:.2f} s); "
          f"generated {json.dumps(first['content'])}")


def test_binding_grafts_the_server_slot(world: dict[str, Any], pushed: dict[str, Any],
                                        ) -> None:
    """llama-cpp-python restores the server's slot on machine B as any llama.cpp graft
    (the document's tokens of it) and computes the question after it: the same tokens as
    server A from its own slot."""
    out = ok_json(kv(world["b"], "graft", REF, "--model", str(world["model"]), "--text",
                     DOC + QUESTION, "--max-new-tokens", "8", "--threads", "2", "--json"))
    n = world["first"]["tokens_evaluated"]
    assert out["digest"] == pushed["digest"] and out["reused_tokens"] == n
    assert out["computed_tokens"] == world["question"]["timings"]["prompt_n"]
    assert out["generated"] == world["question"]["tokens"]


def test_plain_token_list_round_trips_and_restores(world: dict[str, Any]) -> None:
    """The same state with the token list plain, as older servers and
    llama_state_seq_save_file write it: pulled back plain, byte for byte, and restored."""
    from tests.support.llama_server import start_llama_server

    a, b, root = world["a"], world["b"], world["root"]
    pushed = ok_json(kv(a, "push", "--from-llama-state", str(world["plain"]),
                        "docs/server-plain:v1", "--model", str(world["model"]), "--json"))
    assert pushed["token_count"] == world["saved"]["n_saved"]
    slots = root / "slots-plain"
    slots.mkdir()
    ok_json(kv(b, "pull", "docs/server-plain:v1", "--llama-state", "-o",
               str(slots / SLOT_FILE), "--json"))
    assert (slots / SLOT_FILE).read_bytes() == world["plain"].read_bytes()
    server = start_llama_server(world["binary"], world["model"], root / "server-plain.log",
                                args=[*SERVER_ARGS, "--slot-save-path", str(slots)])
    try:
        server.post("/slots/0?action=restore", {"filename": SLOT_FILE})
        again = server.post("/completion", completion(DOC))
    finally:
        server.stop()
    assert again["timings"]["prompt_n"] == 1
    assert again["tokens"] == world["first"]["tokens"]


@pytest.mark.parametrize(("where", "value", "message"), [
    (1, 2, "token list version 2"),  # the packed list's version
    (-1, 1, "media chunks"),  # an image in the slot
])
def test_packed_lists_kvgraft_cannot_read_are_refused(world: dict[str, Any], tmp_path: Path,
                                                      where: int, value: int, message: str,
                                                      ) -> None:
    data = bytearray(world["slot"].read_bytes())
    _, state = slot_tokens(world["slot"])
    at = SEQ_HEADER.size + 4 * where if where >= 0 else state - 4
    struct.pack_into("<i", data, at, value)
    bad = tmp_path / "bad.bin"
    bad.write_bytes(bytes(data))
    r = kv(world["a"], "push", "--from-llama-state", str(bad), "docs/bad:v1", "--model",
           str(world["model"]))
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and not r.stdout


@pytest.fixture(scope="module")
def fewer_layers(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the GGUF that says it has 29 layers: another model's shape."""
    from gguf import GGUFReader

    path = tmp_path_factory.mktemp("other") / "other.gguf"
    shutil.copyfile(model, path)
    field = GGUFReader(path).fields["llama.block_count"]
    index = field.data[0]
    assert field.parts[index].dtype == np.uint32 and int(field.parts[index][0]) == 30
    offset = field.offset + sum(part.nbytes for part in field.parts[:index])
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.uint32(29).tobytes())
    return path


def test_state_of_another_model_is_refused(world: dict[str, Any], fewer_layers: Path,
                                           ) -> None:
    r = kv(world["a"], "push", "--from-llama-state", str(world["plain"]), "docs/other:v1",
           "--model", str(fewer_layers))
    assert r.returncode == 5, r.stderr
    assert "30 layers" in r.stderr and "29" in r.stderr and not r.stdout


def test_truncated_state_is_refused(world: dict[str, Any], tmp_path: Path) -> None:
    data = world["plain"].read_bytes()
    cut = tmp_path / "cut.bin"
    cut.write_bytes(data[: len(data) - 1000])
    r = kv(world["a"], "push", "--from-llama-state", str(cut), "docs/cut:v1", "--model",
           str(world["model"]))
    assert r.returncode == 4, r.stderr
    assert "truncated" in r.stderr and not r.stdout

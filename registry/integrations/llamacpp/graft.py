"""Capture and restore on llama.cpp: prefill, read the sequence state, write a KV file; and
back: open a graft (policy, identity, every byte verified), rebuild the sequence state,
hand it to llama.cpp, and generate from the rest of the prompt."""

from __future__ import annotations

import contextlib
import getpass
import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvgraft import __version__
from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import IncompatibleModel, UsageError
from kvgraft.formats.kvfile import KVLayout, RawTensor, write_kvfile
from kvgraft.formats.manifest import Manifest
from kvgraft.identity.compat import CompatReport
from kvgraft.identity.fingerprint import Fingerprint
from kvgraft.integrations.llamacpp.engine import (
    LlamaModel,
    fit_context,
    last_logits,
    seq_state,
    set_seq_state,
)
from kvgraft.integrations.llamacpp.state import (
    KV_TYPES,
    LayerKV,
    SeqStateBuilder,
    api_header,
    kv_tensors,
    parse_seq_state,
    strip_api_header,
)
from kvgraft.reference import Reference
from kvgraft.services.compat import admit
from kvgraft.transfer.materialise import KVBuffer, read_kv

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Capture:
    path: Path
    token_count: int
    next_token: int
    logits_digest: Digest
    seconds: float
    model: LlamaModel  # the model, reloaded with a larger context when the text needed it


def prefill(lm: LlamaModel, ids: Sequence[int]) -> None:
    """Evaluate `ids` from an empty sequence 0."""
    lm.llm.reset()
    lm.llm._ctx.kv_cache_seq_rm(-1, 0, -1)
    lm.llm.eval(list(ids))


def state_tensors(lm: LlamaModel, count: int) -> list[LayerKV]:
    n, _, layers = parse_seq_state(strip_api_header(seq_state(lm)), lm.shape)
    if n != count:
        raise UsageError(f"llama.cpp holds {n} cells for {count} evaluated tokens")
    return layers


def capture(lm: LlamaModel, output: Path | str, *, token_ids: Sequence[int] | None = None,
            text: str | None = None) -> Capture:
    """Prefill `token_ids` (or the tokens of `text`) and write the KV file `output`."""
    if (token_ids is None) == (text is None):
        raise UsageError("capture takes token ids or text (exactly one)")
    ids = lm.tokenize(text) if text is not None else [int(t) for t in token_ids or []]
    if not ids:
        raise UsageError("nothing to capture: the prefix has no tokens")
    lm = fit_context(lm, len(ids) + 1)
    t0 = datetime.now(UTC)
    start = time.perf_counter()
    prefill(lm, ids)
    seconds = time.perf_counter() - start
    logits = last_logits(lm)
    logits_digest = Digest.of(logits.tobytes())
    path = write_graft(lm.fingerprint, ids, kv_tensors(state_tensors(lm, len(ids))), output,
                       created=t0, text=text, output_extra={
                           "next_token": {"logits": str(logits_digest), "logits_dtype": "F32",
                                          "argmax": int(logits.argmax())},
                           "prefill_seconds": round(seconds, 6)})
    return Capture(path, len(ids), int(logits.argmax()), logits_digest, seconds, lm)


def write_graft(fp: Fingerprint, ids: Sequence[int],
                tensors: list[tuple[RawTensor, RawTensor, int]], output: Path | str, *,
                created: datetime, text: str | None = None,
                input_extra: dict[str, Any] | None = None,
                output_extra: dict[str, Any] | None = None) -> Path:
    """Write the KV file of a llama.cpp sequence with its provenance."""
    digests = {}
    for i, (k, v, _) in enumerate(tensors):
        digests[f"layers.{i}.key"] = str(Digest.of(k.data))
        digests[f"layers.{i}.value"] = str(Digest.of(v.data))
    token_bytes = np.asarray(ids, dtype="<i8").tobytes()
    digests["token_ids"] = str(Digest.of(token_bytes))
    provenance = {
        "created": created.isoformat(), "creator": f"{_user()}@{socket.gethostname()}",
        "kvgraft": __version__, "engine": fp.config["engine"],
        "input": {"token_ids": digests["token_ids"], "token_count": len(ids),
                  "text": str(Digest.of(text.encode())) if text is not None else None,
                  **(input_extra or {})},
        "output": {"tensors": digests, **(output_extra or {})},
        "parents": [],
    }
    return write_kvfile(output, tensors, token_bytes, fp.identity, model_name=fp.name,
                        model_config=fp.config, provenance=provenance)


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


class _Built:
    """The sequence state load_graft built while it verified, until a restore takes it."""

    __slots__ = ("buf", "key", "size")

    def __init__(self, buf: bytearray, key: tuple[int, bool, bytes], size: int) -> None:
        self.buf: bytearray | None = buf
        self.key, self.size = key, size  # key: tokens, V transposed, prefix

    def take(self, key: tuple[int, bool, bytes]) -> tuple[bytearray, int] | None:
        if self.buf is None or key != self.key:
            return None
        buf, self.buf = self.buf, None
        return buf, self.size


@dataclass(frozen=True, slots=True)
class LlamaGraft:
    """A verified graft, as [heads, T, dim] arrays over its KV file's bytes."""

    reference: Reference
    digest: Digest
    manifest: Manifest
    token_ids: tuple[int, ...]
    layers: tuple[LayerKV, ...]
    report: CompatReport
    buffer: KVBuffer  # keeps the bytes the arrays view alive
    built: _Built | None = None

    @property
    def token_count(self) -> int:
        return len(self.token_ids)

    @contextlib.contextmanager
    def state(self, lm: LlamaModel, n: int, *, prefix: bytes | None = None,
              ) -> Iterator[memoryview]:
        """llama.cpp's state bytes of the first `n` tokens after `prefix` (default
        `api_header()`): the ones load_graft built while verifying when they are those, else
        built now. Valid inside the block; the memory then goes back to `lm`'s scratch."""
        if not 0 < n <= self.token_count:
            raise UsageError(f"cannot restore {n} of {self.token_count} tokens")
        head = api_header() if prefix is None else prefix
        got = self.built.take((n, lm.v_trans, head)) if self.built is not None else None
        if got is None:
            buf = lm.scratch.take()
            builder = SeqStateBuilder(self.layers, n, lm.v_trans, prefix=head, into=buf)
            builder.fill(0, n)
            size = builder.release()
        else:
            buf, size = got
        view = memoryview(buf)[:size]
        yield view  # on an exception the memory is dropped, not reused: views may remain
        view.release()
        lm.scratch.give(buf)

    def restore(self, lm: LlamaModel, n: int | None = None) -> float:
        """Make the first `n` tokens (all by default) llama.cpp's sequence 0; seconds."""
        n = self.token_count if n is None else n
        t0 = time.perf_counter()
        with self.state(lm, n) as state:
            set_seq_state(lm, state, list(self.token_ids[:n]))
        return time.perf_counter() - t0


def _check_structure(layout: KVLayout, lm: LlamaModel, what: str) -> None:
    s = lm.shape
    want = lm.fingerprint.config["kv_dtype"]
    if len(layout.layers) != s.layers:
        raise IncompatibleModel(f"{what} has {len(layout.layers)} layers, the model {s.layers}")
    for layer in layout.layers:
        k, v = layer.key, layer.value
        if k.dtype != want or v.dtype != want:
            raise IncompatibleModel(f"{what} holds {k.dtype} tensors, llama.cpp runs a {want} "
                                    "KV cache: kvgraft does not cast a cache")
        if (layer.start != 0 or (k.shape[0], k.shape[2]) != (s.kv_heads, s.head_dim)
                or (v.shape[0], v.shape[2]) != (s.kv_heads, s.v_head_dim)):
            raise IncompatibleModel(f"{what} layer {layer.index} is {list(k.shape)}, the "
                                    f"model needs [{s.kv_heads}, T, {s.head_dim}] from 0")


def _array(buf: KVBuffer, base: int, info: Any) -> Any:
    kind = next(t for name, t in KV_TYPES.values() if name == info.dtype)
    flat = np.frombuffer(buf, dtype=kind, count=info.nbytes // info.itemsize,
                         offset=base + info.begin)
    return flat.reshape(info.shape)


def all_tokens(ids: tuple[int, ...]) -> int:
    return len(ids)


def load_graft(registry: Registry, lm: LlamaModel, ref: Reference | str, *,
               force_incompatible: bool = False, require_signed_by: Sequence[str] = (),
               require_verified: bool = False, for_verification: bool = False,
               build: Callable[[tuple[int, ...]], int] = all_tokens,
               prefix: bytes | None = None) -> LlamaGraft:
    """Open `ref` under the policy, refuse it unless it belongs to `lm` (or, forced, record
    that in the audit log), and read it through the machine cache, every byte verified.

    While it verifies, each chunk is also copied into llama.cpp's state layout for the first
    `build(token ids)` tokens after `prefix` (see LlamaGraft.state), on the verifying
    threads: converting overlaps hashing, and a restore of those tokens only hands the
    state to llama.cpp. The token ids `build` sees there are not yet verified; the state is
    kept only if it gives the same count for the verified ones."""
    reference = Reference.parse(ref) if isinstance(ref, str) else ref
    opened = registry.open(reference, require_signed_by=require_signed_by,
                           require_verified=require_verified, model=lm.identity,
                           for_verification=for_verification, action="load")
    what = f"graft {reference}"
    report = admit(registry.events, reference, opened.digest, opened.manifest, lm.fingerprint,
                   force_incompatible=force_incompatible, log=log)
    head = api_header() if prefix is None else prefix
    builders: list[SeqStateBuilder] = []
    buf = lm.scratch.take()

    def fill(layout: KVLayout, kv: KVBuffer, base: int) -> Callable[[int, int], None]:
        _check_structure(layout, lm, what)
        for old in builders:  # of a kept copy that failed its check: its views go first
            old.release()
        builders.clear()
        n = min(build(_token_ids(kv, base, layout)), layout.token_count)
        if n <= 0:
            return lambda start, end: None
        builders.append(SeqStateBuilder(_layers(kv, base, layout), n, lm.v_trans,
                                        prefix=head, into=buf))
        return builders[-1].fill

    try:
        layout, kv, base = read_kv(opened.manifest, opened.fetcher, fill=fill)
    except BaseException:
        for old in builders:
            old.release()
        lm.scratch.give(buf)
        raise
    if not registry.config.offline and reference.tag is not None:
        registry.cache.put_ref(reference, opened.digest)
    tokens = _token_ids(kv, base, layout)
    built = None
    if builders:
        builder = builders[-1]
        size = builder.release()
        if builder.n == min(build(tokens), len(tokens)):
            built = _Built(buf, (builder.n, lm.v_trans, head), size)
    if built is None:
        lm.scratch.give(buf)
    return LlamaGraft(reference, opened.digest, opened.manifest, tokens,
                      _layers(kv, base, layout), report, kv, built)


def _token_ids(buf: KVBuffer, base: int, layout: KVLayout) -> tuple[int, ...]:
    return tuple(np.frombuffer(buf, dtype="<i8", count=layout.token_count,
                               offset=base + layout.token_ids.begin).tolist())


def _layers(buf: KVBuffer, base: int, layout: KVLayout) -> tuple[LayerKV, ...]:
    return tuple(LayerKV(_array(buf, base, li.key), _array(buf, base, li.value), li.key.dtype)
                 for li in layout.layers)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def greedy(lm: LlamaModel, feed: Sequence[int], steps: int, *, stop: set[int] | None = None,
           ) -> list[tuple[Any, int]]:
    """Feed `feed`, then `steps` greedy tokens; (last logits, chosen token) per eval."""
    if not feed:
        raise UsageError("nothing to feed the model: the prompt adds no tokens")
    lm.llm.eval(list(feed))
    out: list[tuple[Any, int]] = []
    for i in range(steps + 1):
        logits = last_logits(lm)
        token = int(logits.argmax())
        out.append((logits, token))
        if i == steps or (stop and token in stop):
            break
        lm.llm.eval([token])
    return out


@dataclass(frozen=True, slots=True)
class GraftResult:
    digest: Digest
    prompt_tokens: int
    graft_tokens: int
    reused: int
    tokens: tuple[int, ...]
    text: str
    load_seconds: float
    restore_seconds: float
    generate_seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"digest": str(self.digest), "prompt_tokens": self.prompt_tokens,
                "graft_tokens": self.graft_tokens, "reused_tokens": self.reused,
                "computed_tokens": self.prompt_tokens - self.reused,
                "generated": list(self.tokens), "text": self.text,
                "load_seconds": round(self.load_seconds, 6),
                "restore_seconds": round(self.restore_seconds, 6),
                "generate_seconds": round(self.generate_seconds, 6)}


def graft_generate(registry: Registry, lm: LlamaModel, ref: Reference | str, *,
                   prompt: str | None = None, prompt_ids: Sequence[int] | None = None,
                   max_new_tokens: int = 32, force_incompatible: bool = False,
                   require_signed_by: Sequence[str] = (),
                   require_verified: bool = False) -> tuple[GraftResult, LlamaModel]:
    """Generate greedily from `prompt` with its common prefix with `ref` restored rather
    than computed. Returns the result and the model (reloaded when the context grew)."""
    if (prompt is None) == (prompt_ids is None):
        raise UsageError("graft_generate takes a prompt or prompt ids (exactly one)")
    if max_new_tokens < 1:
        raise UsageError("max_new_tokens must be at least 1")
    ids = lm.tokenize(prompt) if prompt is not None else [int(t) for t in prompt_ids or []]
    if not ids:
        raise UsageError("the prompt has no tokens")
    lm = fit_context(lm, len(ids) + max_new_tokens)

    def reusable(graft_ids: Sequence[int]) -> int:
        return min(common_prefix(graft_ids, ids), len(ids) - 1)

    t0 = time.perf_counter()
    graft = load_graft(registry, lm, ref, force_incompatible=force_incompatible,
                       require_signed_by=require_signed_by, require_verified=require_verified,
                       build=reusable)
    t1 = time.perf_counter()
    reused = reusable(graft.token_ids)
    if reused:
        graft.restore(lm, reused)
    else:
        prefill(lm, [])
    t2 = time.perf_counter()
    steps = greedy(lm, ids[reused:], max_new_tokens - 1, stop={lm.eos})
    tokens = tuple(t for _, t in steps)
    result = GraftResult(graft.digest, len(ids), graft.token_count, reused, tokens,
                         lm.detokenize(list(tokens)), t1 - t0, t2 - t1,
                         time.perf_counter() - t2)
    return result, lm

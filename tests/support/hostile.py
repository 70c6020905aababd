"""Writes the committed hostile KV files in tests/data/hostile/ (run as a module to
refresh them; test_kvfile checks the committed bytes still match what this writes)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

from tests.support.synthetic import write_synthetic

HOSTILE = Path(__file__).parent.parent / "data" / "hostile"


def _good(path: Path) -> bytes:
    write_synthetic(path, num_layers=2, kv_heads=1, head_dim=4, tokens=8, seed=7)
    return path.read_bytes()


def _split(data: bytes) -> tuple[dict[str, object], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict[str, object], body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _edit(fn: Callable[[dict[str, object]], None]) -> Callable[[bytes], bytes]:
    def apply(data: bytes) -> bytes:
        header, body = _split(data)
        fn(header)
        return _join(header, body)

    return apply


def _meta(key: str, value: str | None) -> Callable[[dict[str, object]], None]:
    def fn(h: dict[str, object]) -> None:
        meta = h["__metadata__"]
        assert isinstance(meta, dict)
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value

    return fn


def _tensor(name: str, **changes: object) -> Callable[[dict[str, object]], None]:
    def fn(h: dict[str, object]) -> None:
        entry = h[name]
        assert isinstance(entry, dict)
        entry.update(changes)

    return fn


def _drop_tensor(name: str) -> Callable[[dict[str, object]], None]:
    def fn(h: dict[str, object]) -> None:
        h.pop(name)

    return fn


def _garble_header(data: bytes) -> bytes:
    n: int = struct.unpack("<Q", data[:8])[0]
    return data[:8] + b"{" * n + data[8 + n :]


def _raw_header(fn: Callable[[str], str]) -> Callable[[bytes], bytes]:
    """Rewrite the header text itself, for what json.dumps cannot write."""
    def apply(data: bytes) -> bytes:
        (n,) = struct.unpack("<Q", data[:8])
        raw = fn(data[8 : 8 + n].decode().rstrip()).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw + data[8 + n :]

    return apply


def _deep(text: str) -> str:
    return '{"deep":' + "[" * 2000 + "]" * 2000 + "," + text[1:]


# name -> (transformation of a good file, substring the error message must contain)
CASES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "empty.kv": (lambda d: b"", "shorter than a safetensors header"),
    "truncated-header.kv": (lambda d: d[:20], "does not fit"),
    "truncated-data.kv": (lambda d: d[:-5], "tensor data ends"),
    "trailing-bytes.kv": (lambda d: d + b"\0" * 8, "tensor data ends"),
    "huge-header-length.kv": (lambda d: struct.pack("<Q", 1 << 60) + d[8:], "does not fit"),
    "header-not-json.kv": (lambda d: _garble_header(d), "not JSON"),
    "no-format.kv": (_edit(_meta("kvgraft.format", None)), "kvgraft.format"),
    "wrong-format.kv": (_edit(_meta("kvgraft.format", "9")), "kvgraft.format"),
    "no-architecture.kv": (_edit(_meta("model.architecture", None)), "model.architecture"),
    "bad-digest.kv": (_edit(_meta("model.tokenizer", "sha256:xyz")), "model identity"),
    "bad-start.kv": (_edit(_meta("layers.1.start", "-3")), "layers.1.start"),
    "start-past-end.kv": (_edit(_meta("layers.1.start", "4")), "must end at position"),
    "token-ids-f32.kv": (_edit(_tensor("token_ids", dtype="F32", shape=[16])), "token_ids"),
    "unknown-dtype.kv": (_edit(_tensor("layers.0.key", dtype="Q4")), "unknown dtype"),
    "shape-mismatch.kv": (_edit(_tensor("layers.0.key", shape=[1, 8, 5])), "does not match"),
    "missing-value.kv": (_edit(lambda h: h.update(
        {"layers.2.value": h.pop("layers.1.value")})), "key and value"),
    "gap.kv": (_edit(_drop_tensor("layers.1.value")), "contiguous"),
    "extra-tensor.kv": (_edit(lambda h: h.update(
        {"bonus": h.pop("layers.1.value")})), "unexpected tensor"),
    "overlap.kv": (_edit(_tensor("layers.0.value", data_offsets=[0, 64])), "contiguous"),
    "bad-provenance.kv": (_edit(_meta("provenance", "{not json")), "provenance"),
    "deep-nesting.kv": (_raw_header(_deep), "nested"),
    "huge-int-shape.kv": (_raw_header(lambda t: t.replace(
        '"shape":[1,8,4]', '"shape":[1,8,' + "4" * 5000 + "]", 1)), "5000 digits"),
    "config-not-object.kv": (_edit(_meta("model.config", "[1, 2]")), "not a JSON object"),
    "config-nan.kv": (_edit(_meta("model.config", '{"x": NaN}')), "NaN"),
    "config-infinity.kv": (_edit(_meta("model.config", '{"x": -Infinity}')), "Infinity"),
    "config-overflow.kv": (_edit(_meta("model.config", '{"x": 1e999999}')), "overflows"),
    "config-deep.kv": (_edit(_meta("model.config", "[" * 100 + "]" * 100)), "nested"),
    "lone-surrogate.kv": (_edit(_meta("model.name", "bad\ud800name")), "lone surrogate"),
    "surrogate-in-config.kv": (_edit(_meta("model.config", '{"a": "\\udc00"}')),
                               "lone surrogate"),
    "start-arabic-digit.kv": (_edit(_meta("layers.1.start", "\u0660")), "layers.1.start"),
    "start-fullwidth-digit.kv": (_edit(_meta("layers.1.start", "\uff10")), "layers.1.start"),
    "start-superscript.kv": (_edit(_meta("layers.1.start", "\u00b2")), "layers.1.start"),
    "start-5000-digits.kv": (_edit(_meta("layers.1.start", "1" * 5000)), "layers.1.start"),
    "model-name-long.kv": (_edit(_meta("model.name", "m" * 256)), "model.name"),
    "model-name-nul.kv": (_edit(_meta("model.name", "a\x00b")), "model.name"),
}


def write_all(root: Path = HOSTILE) -> None:
    root.mkdir(parents=True, exist_ok=True)
    good = _good(root / "good.kv")
    for name, (transform, _) in CASES.items():
        (root / name).write_bytes(transform(good))


if __name__ == "__main__":
    write_all()

"""The chunk codecs: the byte-plane codec on real KV, codec choice, and hostile blobs."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from kvgraft.codecs import bytegroup, planelayout
from kvgraft.codecs.codec import (
    AUTO,
    best_codec_name,
    codec_names,
    codec_selector,
    decode_blob,
    frame,
    get_codec,
    parse_frame,
    push_codec_names,
)
from kvgraft.errors import IntegrityError, UnknownCodec
from kvgraft.formats.chunks import gather, plan_chunks
from kvgraft.formats.kvfile import read_layout, safetensors_header
from tests.support.harness import RegistryFactory
from tests.support.synthetic import to_dtype, write_synthetic

SAMPLE = Path(__file__).parent / "data" / "smollm2-bf16.kv"


def stored(name: str, data: bytes) -> bytes:
    return b"".join(bytes(p) for p in frame(get_codec(name), data))


def sample_payload() -> bytes:
    layout = read_layout(SAMPLE)
    fd = os.open(SAMPLE, os.O_RDONLY)
    try:
        (plan,) = plan_chunks(layout, layout.token_count)
        return bytes(gather(fd, plan, bytearray()))
    finally:
        os.close(fd)


def payload(*tensors: tuple[str, bytes]) -> bytes:
    entries = [(f"t{i}", dtype, (len(data),), len(data)) for i, (dtype, data) in
               enumerate(tensors)]
    return safetensors_header(entries) + b"".join(data for _, data in tensors)


def test_sample_is_real_bf16_kv() -> None:
    layout = read_layout(SAMPLE)
    assert SAMPLE.stat().st_size < 2_100_000
    assert {t.dtype for lr in layout.layers for t in (lr.key, lr.value)} == {"BF16"}
    assert len(layout.layers) == 30 and layout.layers[0].key.shape == (3, 80, 64)


def test_bytegroup_beats_zstd_on_real_bf16_kv() -> None:
    data = sample_payload()
    sizes = {}
    for name in ("zstd", bytegroup.NAME):
        blob = stored(name, data)
        assert decode_blob(blob, len(data)) == (name, data) or \
            bytes(decode_blob(blob, len(data))[1]) == data
        sizes[name] = len(blob)
    # Deterministic sizes, not timings: the ratio the issue asks for on real KV.
    assert len(data) / sizes[bytegroup.NAME] >= 1.45
    assert sizes[bytegroup.NAME] < sizes["zstd"] / 1.1


def test_mantissa_plane_is_stored_raw_and_exponent_plane_compressed() -> None:
    data = sample_payload()
    body = parse_frame(stored(bytegroup.NAME, data))[2]
    (_, count) = struct.unpack_from("<BI", body, 0)
    at, methods = 5, []
    for _ in range(count):
        width, rotated, _length = struct.unpack_from("<BBQ", body, at)
        at += 10
        planes = [struct.unpack_from("<BQ", body, at + 9 * j)[0] for j in range(width)]
        at += 9 * width
        methods.append((width, bool(rotated), planes))
    assert methods == [(1, False, [planelayout.ZSTD]),
                       (2, True, [planelayout.RAW, planelayout.ZSTD])]


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("count", [999, 2 * bytegroup.MERGE_BLOCK + 3])  # blocks, a partial last
def test_planes_split_and_merge_inverse(width: int, rotated: bool, count: int) -> None:
    raw = np.random.default_rng(width).integers(0, 256, count * width, dtype=np.uint8).tobytes()
    scratch = bytegroup._Scratch()
    planes = [p.copy() for p in bytegroup.split_planes(memoryview(raw), width, rotated, scratch)]
    values = np.frombuffer(raw, f"<u{width}")
    top = values >> (8 * width - 1) if rotated else None
    assert (planes[-1] >> 7 == (values >> (8 * width - 2) & 1)).all() if rotated else \
        (planes[-1] == (values >> (8 * width - 8)).astype(np.uint8)).all()
    if top is not None:
        assert (planes[0] & 1 == top).all()  # the sign went to the lowest bit
    out = bytearray(len(raw))
    bytegroup.merge_planes(planes, width, rotated, memoryview(out), scratch)
    assert bytes(out) == raw


def test_mixed_dtypes_get_their_own_planes() -> None:
    x = np.linspace(-3, 3, 301, dtype=np.float32)
    data = payload(("BF16", to_dtype(x, "BF16")), ("I64", bytes(range(64))),
                   ("F32", to_dtype(x, "F32")), ("F16", to_dtype(x[:5], "F16")))
    segs = bytegroup.hint_segments(data)
    assert [(s.width, s.rotated) for s in segs] == [(1, False), (2, True), (1, False),
                                                   (4, True), (2, True)]
    assert sum(s.length for s in segs) == len(data)
    assert bytes(decode_blob(stored(bytegroup.NAME, data), len(data))[1]) == data


def test_auto_picks_per_blob() -> None:
    x = np.ones(64, np.float32)
    assert best_codec_name(payload(("BF16", to_dtype(x, "BF16")))) == bytegroup.NAME
    assert best_codec_name(payload(("F32", to_dtype(x, "F32")))) == bytegroup.NAME
    assert best_codec_name(payload(("I64", bytes(64)))) == "zstd"
    assert best_codec_name(b"not a safetensors payload") == "zstd"
    select = codec_selector(AUTO)
    assert select(sample_payload()).name == bytegroup.NAME
    assert codec_selector("raw")(sample_payload()).name == "raw"
    assert AUTO in push_codec_names() and AUTO not in codec_names()


def test_auto_is_not_a_stored_codec() -> None:
    with pytest.raises(UnknownCodec):
        get_codec(AUTO)


def test_unknown_codec_name_is_refused_with_exit_4() -> None:
    blob = stored("zstd", b"hello")
    forged = blob[:5] + bytes([6]) + b"lzma99" + blob[6 + 4:]
    with pytest.raises(UnknownCodec, match="unknown codec 'lzma99'") as info:
        decode_blob(forged, 5)
    assert info.value.exit_code == 4


@pytest.mark.parametrize("name", ["raw", "zstd", bytegroup.NAME])
def test_declared_size_must_match(name: str) -> None:
    data = sample_payload()[:100_001]
    blob = stored(name, data)
    for wrong in (len(data) - 1, len(data) + 1, 0):
        with pytest.raises(IntegrityError):
            decode_blob(blob, wrong)
        # A frame header that lies in agreement with the caller is caught by the body.
        name_len = blob[5]
        at = 6 + name_len
        lying = blob[:at] + struct.pack("<Q", wrong) + blob[at + 8:]
        with pytest.raises(IntegrityError):
            decode_blob(lying, wrong)


@pytest.mark.parametrize("name", ["raw", "zstd", bytegroup.NAME])
def test_decode_into_a_reused_buffer(name: str) -> None:
    data = sample_payload()[:100_001]
    blob = stored(name, data)
    buf = bytearray(len(data) + 64)  # larger than needed, as a pooled buffer may be
    for _ in range(2):
        buf[:] = b"\xee" * len(buf)
        got_name, out = decode_blob(blob, len(data), buf)
        view = memoryview(out)
        assert got_name == name and bytes(view) == data and view.obj is buf
    with pytest.raises(IntegrityError):  # the declared size is still checked first
        decode_blob(blob, len(data) - 1, buf)
    with pytest.raises(ValueError, match="decode buffer"):
        decode_blob(blob, len(data), bytearray(len(data) - 1))


def test_bomb_is_refused_before_allocating() -> None:
    # A body that claims a 2**60-byte segment, for a caller that expects 10 bytes.
    body = struct.pack("<BI", 1, 1) + struct.pack("<BBQ", 1, 0, 1 << 60) + \
        struct.pack("<BQ", 0, 10) + bytes(10)
    codec = get_codec(bytegroup.NAME)
    with pytest.raises(IntegrityError, match="more than the declared"):
        codec.decode(memoryview(body), 10)
    many = struct.pack("<BI", 1, 0xFFFFFFFF)
    with pytest.raises(IntegrityError, match="segments"):
        codec.decode(memoryview(many), 10)


def test_corrupt_zstd_plane_is_detected() -> None:
    data = sample_payload()
    blob = bytearray(stored(bytegroup.NAME, data))
    body_at = len(blob) - parse_frame(bytes(blob))[2].nbytes
    blob[body_at + 60] ^= 0xFF  # inside the first compressed plane (the header segment)
    with pytest.raises(IntegrityError):
        _, out = decode_blob(bytes(blob), len(data))
        if hashlib.sha256(out).digest() != hashlib.sha256(data).digest():
            raise IntegrityError("digest mismatch")


def test_push_defaults_to_bytegroup_and_pull_is_byte_exact(make_registry: RegistryFactory,
                                                            tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=600, dtype="BF16")
    reg = make_registry()
    reg.push(src, "t/a")
    chunks = reg.inspect("t/a").to_json()["chunks"]
    assert all(c["codec"] == bytegroup.NAME and c["stored_size"] < c["size"] for c in chunks)
    out = tmp_path / "out.kv"
    reg.pull("t/a", output=out)
    assert out.read_bytes() == src.read_bytes()


def test_codec_choice_keeps_the_artifact_digest(make_registry: RegistryFactory,
                                                tmp_path: Path) -> None:
    from kvgraft.transfer.push import PushOptions

    src = write_synthetic(tmp_path / "a.kv", tokens=300, dtype="F16")
    digests = {make_registry(home=tmp_path / name).push(
        src, "t/a", options=PushOptions(codec=name)).digest for name in push_codec_names()}
    assert len(digests) == 1


BACKENDS = [False, True] if bytegroup.HAVE_LIBZSTD else [False]


@pytest.mark.parametrize("writer", BACKENDS)
@pytest.mark.parametrize("reader", BACKENDS)
def test_zstd_backends_read_each_other(writer: bool, reader: bool) -> None:
    # With or without the direct libzstd binding the body is the same format: a blob stored
    # by one install decodes on any other.
    x = np.linspace(-3, 3, 4001, dtype=np.float32)
    for data in (sample_payload(), payload(("F16", to_dtype(x, "F16")), ("I64", bytes(80)),
                                           ("F32", to_dtype(x, "F32")))):
        body = bytegroup.ByteGroupCodec(libzstd=writer).encode(data)
        out = bytegroup.ByteGroupCodec(libzstd=reader).decode(memoryview(body), len(data))
        assert bytes(out) == data


def test_level_1_is_the_tuned_default() -> None:
    data = sample_payload()
    tuned = bytes(get_codec(bytegroup.NAME).encode(data))
    assert bytes(get_codec(bytegroup.NAME, 1).encode(data)) == tuned
    assert len(get_codec(bytegroup.NAME, 3).encode(data)) != len(tuned)


def test_encoded_bodies_do_not_share_memory() -> None:
    # Bodies outlive the call (stores may hold them): a later encode on the same thread must
    # not write into an earlier body.
    codec = get_codec(bytegroup.NAME)
    a, b = sample_payload(), payload(("BF16", bytes(range(256)) * 64))
    first = codec.encode(a)
    kept = bytes(first)
    codec.encode(b)
    codec.encode(a[::-1])
    assert bytes(first) == kept
    assert bytes(codec.decode(memoryview(first), len(a))) == a


@pytest.mark.parametrize("libzstd", BACKENDS)
def test_plane_with_a_second_zstd_frame_is_refused(libzstd: bool) -> None:
    data = bytes(range(100)) * 50
    frame_ = bytes(zstandard_frame(data))
    for plane in (frame_ + frame_, frame_ + b"\0", frame_[:-1]):
        body = struct.pack("<BI", 1, 1) + struct.pack("<BBQ", 1, 0, len(data)) + \
            struct.pack("<BQ", planelayout.ZSTD, len(plane)) + plane
        with pytest.raises(IntegrityError):
            bytegroup.ByteGroupCodec(libzstd=libzstd).decode(memoryview(body), len(data))


def zstandard_frame(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data)

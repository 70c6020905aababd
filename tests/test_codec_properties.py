"""Properties of every codec: byte-exact round trips and fail-closed decoding."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgraft.codecs.bytegroup import HAVE_LIBZSTD, ByteGroupCodec
from kvgraft.codecs.bytegroup import NAME as BYTEGROUP
from kvgraft.codecs.codec import codec_names, codec_selector, decode_blob, frame, get_codec
from kvgraft.errors import IntegrityError
from kvgraft.formats.kvfile import ITEMSIZE, safetensors_header

CODECS = codec_names()
assert BYTEGROUP in CODECS

tensor = st.tuples(st.sampled_from(sorted(ITEMSIZE)), st.integers(0, 700)).flatmap(
    lambda spec: st.tuples(st.just(spec[0]), st.binary(min_size=spec[1] * ITEMSIZE[spec[0]],
                                                       max_size=spec[1] * ITEMSIZE[spec[0]])))


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """A safetensors payload of random tensors, or (sometimes) arbitrary bytes."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=3000))
    tensors = draw(st.lists(tensor, max_size=5))
    entries = [(f"t{i}", dtype, (len(data) // ITEMSIZE[dtype],), len(data))
               for i, (dtype, data) in enumerate(tensors)]
    return safetensors_header(entries) + b"".join(data for _, data in tensors)


def encode(name: str, data: bytes) -> bytes:
    return b"".join(bytes(p) for p in frame(get_codec(name), data))


def decode_checked(blob: bytes, data: bytes) -> bytes:
    """What a reader does: decode to the expected size, then check the digest."""
    _, out = decode_blob(blob, len(data))
    if hashlib.sha256(out).digest() != hashlib.sha256(data).digest():
        raise IntegrityError("digest mismatch")
    return bytes(out)


@settings(max_examples=200, deadline=None)
@given(data=payloads())
def test_every_codec_round_trips(data: bytes) -> None:
    for name in CODECS:
        name_out, out = decode_blob(encode(name, data), len(data))
        assert name_out == name and bytes(out) == data
    chosen = codec_selector("auto")(data)
    assert bytes(decode_blob(encode(chosen.name, data), len(data))[1]) == data


@settings(max_examples=200, deadline=None)
@given(data=payloads(), where=st.integers(0), flip=st.integers(1, 255),
       name=st.sampled_from(CODECS))
def test_corruption_is_detected(data: bytes, where: int, flip: int, name: str) -> None:
    blob = bytearray(encode(name, data))
    blob[where % len(blob)] ^= flip
    try:
        out = decode_checked(bytes(blob), data)
    except IntegrityError:
        return
    assert out == data  # a flip that changes nothing decoded (e.g. an unused header bit)


@settings(max_examples=200, deadline=None)
@given(data=payloads(), cut=st.integers(1), name=st.sampled_from(CODECS))
def test_truncation_is_refused(data: bytes, cut: int, name: str) -> None:
    blob = encode(name, data)
    short = blob[: len(blob) - 1 - cut % len(blob)]
    try:
        decode_checked(short, data)
    except IntegrityError:
        return
    raise AssertionError("a truncated blob decoded")


@settings(max_examples=100, deadline=None)
@given(data=payloads().filter(len), less=st.integers(1), name=st.sampled_from(CODECS))
def test_declared_size_smaller_than_data_is_refused(data: bytes, less: int, name: str) -> None:
    smaller = len(data) - 1 - less % len(data)
    body = get_codec(name).encode(data)
    try:
        get_codec(name).decode(memoryview(bytes(memoryview(body))), smaller)
    except IntegrityError:
        return
    raise AssertionError("decoded more bytes than declared")


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=400), size=st.integers(0, 1 << 20),
       libzstd=st.sampled_from([False, True] if HAVE_LIBZSTD else [False]))
def test_hostile_bytegroup_body_never_crashes(body: bytes, size: int, libzstd: bool) -> None:
    try:
        out = ByteGroupCodec(libzstd=libzstd).decode(memoryview(body), size)
    except IntegrityError:
        return
    assert memoryview(out).nbytes == size


@settings(max_examples=150, deadline=None)
@given(data=payloads(), where=st.integers(0), flip=st.integers(1, 255))
def test_public_zstd_backend_round_trips_and_detects_corruption(data: bytes, where: int,
                                                                flip: int) -> None:
    # The path taken where python-zstandard has no libzstd binding.
    codec = ByteGroupCodec(libzstd=False)
    body = bytearray(memoryview(codec.encode(data)))
    assert bytes(codec.decode(memoryview(bytes(body)), len(data))) == data
    body[where % len(body)] ^= flip
    try:
        out = codec.decode(memoryview(bytes(body)), len(data))
    except IntegrityError:
        return
    # Not refused: then exactly the declared size, for the caller's digest check to judge.
    assert memoryview(out).nbytes == len(data)

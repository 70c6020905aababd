"""Streamed decoding (kvgraft.codecs.stream) gives exactly what whole-blob decoding gives,
piece by piece, and refuses every blob whole-blob decoding refuses."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest

from kvgraft.codecs.codec import codec_names, decode_blob, frame, get_codec
from kvgraft.codecs.stream import decoded_pieces
from kvgraft.errors import IntegrityError
from tests.support.synthetic import write_synthetic


def _stored(name: str, data: bytes) -> bytes:
    return b"".join(bytes(p) for p in frame(get_codec(name), data))


def _streamed(stored: bytes, size: int, piece: int = 1 << 20) -> bytes:
    return b"".join(bytes(p) for p in decoded_pieces(io.BytesIO(stored), size, piece=piece))


@pytest.fixture(scope="module")
def payloads(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    kv = write_synthetic(tmp_path_factory.mktemp("kv") / "g.kv", tokens=200)
    return [Path(kv).read_bytes(), b"", b"x" * 5, random.Random(1).randbytes(70_001)]


@pytest.mark.parametrize("name", codec_names())
def test_streamed_decoding_matches_whole_decoding(name: str, payloads: list[bytes]) -> None:
    for data in payloads:
        stored = _stored(name, data)
        assert bytes(decode_blob(stored, len(data))[1]) == data
        for piece in (7, 4096, 1 << 20):
            assert _streamed(stored, len(data), piece) == data


@pytest.mark.parametrize("name", codec_names())
def test_streamed_decoding_refuses_what_whole_decoding_refuses(name: str,
                                                               payloads: list[bytes]) -> None:
    data = payloads[0]
    stored = _stored(name, data)
    bad = [stored + b"\0", stored[:-1], stored[:40]]
    flipped = bytearray(stored)
    flipped[len(stored) // 2] ^= 0xFF
    for blob in bad:
        with pytest.raises(IntegrityError):
            decode_blob(blob, len(data))
        with pytest.raises(IntegrityError):
            _streamed(blob, len(data))
    with pytest.raises(IntegrityError):
        _streamed(stored, len(data) + 1)  # the header's size is checked first
    try:
        whole = bytes(decode_blob(bytes(flipped), len(data))[1])
    except IntegrityError:
        with pytest.raises(IntegrityError):
            _streamed(bytes(flipped), len(data))
    else:  # a flip the codec cannot see: both give the same (wrong) bytes, the hash tells
        assert _streamed(bytes(flipped), len(data)) == whole

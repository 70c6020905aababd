from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from kvgraft.errors import InvalidKVFile, UsageError
from kvgraft.formats.kvfile import hash_file, read_layout
from tests.support.hostile import CASES, HOSTILE, write_all
from tests.support.synthetic import synthetic_identity, write_synthetic


def test_layout_of_sliding_window_file(tmp_path: Path) -> None:
    path = write_synthetic(tmp_path / "a.kv", num_layers=3, kv_heads=2, head_dim=8,
                           tokens=50, window=16, sliding=[1])
    layout = read_layout(path)
    assert layout.token_count == 50
    assert [(lr.start, lr.length) for lr in layout.layers] == [(0, 50), (34, 16), (0, 50)]
    assert layout.identity == synthetic_identity()
    assert layout.file_size == path.stat().st_size
    assert layout.provenance["seed"] == 0


def test_written_file_is_plain_safetensors(tmp_path: Path) -> None:
    path = write_synthetic(tmp_path / "a.kv", dtype="F32", num_layers=2, tokens=10)
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata()["kvgraft.format"] == "1"
        assert f.get_tensor("layers.1.value").shape == (2, 10, 16)
        assert f.get_tensor("token_ids").dtype == np.int64


def test_hash_file_matches_hashlib(tmp_path: Path) -> None:
    import hashlib

    path = write_synthetic(tmp_path / "a.kv", tokens=300)
    layout = read_layout(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        whole, per = hash_file(fd, layout, block=1000)  # blocks straddle tensor edges
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert whole.hex == hashlib.sha256(data).hexdigest()
    for t in layout.tensors:
        assert per[t.name].hex == hashlib.sha256(data[t.begin : t.end]).hexdigest()


def test_committed_hostile_fixtures_are_current(tmp_path: Path) -> None:
    write_all(tmp_path)
    for name in [*CASES, "good.kv"]:
        assert (tmp_path / name).read_bytes() == (HOSTILE / name).read_bytes(), name


def test_good_fixture_reads() -> None:
    assert read_layout(HOSTILE / "good.kv").token_count == 8


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_file_refused(name: str) -> None:
    with pytest.raises(InvalidKVFile, match=CASES[name][1]) as e:
        read_layout(HOSTILE / name)
    assert e.value.exit_code == 4
    assert name in e.value.message  # the message names the file


def test_missing_file_is_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        read_layout(tmp_path / "nope.kv")
    with pytest.raises(UsageError):
        read_layout(tmp_path)

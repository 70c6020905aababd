"""The blob-store contract, once, for every store: local, memory and a real S3 on loopback."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvgraft.blobstore import BlobStore, blob_path, open_store
from kvgraft.blobstore.local import LocalBlobStore
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, NotFound, Unavailable


@pytest.fixture
def store(store_url: str) -> BlobStore:
    return open_store(store_url)


def blob(n: int, seed: int = 0) -> tuple[Digest, bytes]:
    data = os.urandom(n) if seed < 0 else bytes((seed + i) % 251 for i in range(n))
    return Digest.of(data), data


def test_round_trip(store: BlobStore) -> None:
    digest, data = blob(300_000, -1)
    assert not store.exists(digest)
    assert store.put(digest, [data[:10], bytearray(data[10:1000]), memoryview(data)[1000:]])
    assert store.exists(digest)
    assert store.get(digest) == data
    with store.open(digest) as f:
        pieces = []
        while piece := f.read(65_536):
            pieces.append(piece)
    assert b"".join(pieces) == data
    info = store.stat(digest)
    assert info is not None
    assert (info.digest, info.stored_size) == (digest, len(data))
    assert abs(info.mtime - time.time()) < 120


def test_url_reopens_the_same_store(store: BlobStore) -> None:
    digest, data = blob(1000, 7)
    store.put(digest, [data])
    assert open_store(store.url).get(digest) == data


def test_second_put_stores_nothing(store: BlobStore) -> None:
    digest, first = blob(5000, 1)
    assert store.put(digest, [first]) is True
    # The key names decoded content, so a second writer may bring other stored bytes
    # (another codec); the first stored encoding wins and is never rewritten.
    assert store.put(digest, [b"other encoding of the same content"]) is False
    assert store.get(digest) == first
    info = store.stat(digest)
    assert info is not None and info.stored_size == len(first)


def test_missing_blob(store: BlobStore) -> None:
    digest, _ = blob(10, 3)
    assert store.stat(digest) is None
    assert not store.exists(digest)
    with pytest.raises(NotFound) as e:
        store.get(digest)
    assert e.value.exit_code == 3 and digest.hex in str(e.value)
    with pytest.raises(NotFound):
        store.open(digest)
    assert store.delete(digest) is False


def test_delete_and_iter(store: BlobStore) -> None:
    blobs = dict(blob(100 + i, i) for i in range(5))
    for digest, data in blobs.items():
        store.put(digest, [data])
    listed = {info.digest: info.stored_size for info in store.iter()}
    assert listed == {d: len(b) for d, b in blobs.items()}
    gone = sorted(blobs)[2]
    assert store.delete(gone) is True
    assert not store.exists(gone)
    with pytest.raises(NotFound):
        store.get(gone)
    assert {info.digest for info in store.iter()} == set(blobs) - {gone}
    # A deleted digest can be stored again (gc then a re-push).
    assert store.put(gone, [blobs[gone]]) is True


def test_empty_blob(store: BlobStore) -> None:
    digest = Digest.of(b"")
    assert store.put(digest, []) is True
    assert store.get(digest) == b""
    with store.open(digest) as f:
        assert f.read() == b""
    info = store.stat(digest)
    assert info is not None and info.stored_size == 0
    assert store.put(digest, [b""]) is False


def test_concurrent_puts_of_one_digest(store: BlobStore) -> None:
    """Racing writers: exactly one wins and the stored blob is one writer's bytes, whole."""
    digest = Digest.of(b"the content")
    candidates = [bytes([i]) * 400_000 for i in range(4)]
    barrier = threading.Barrier(len(candidates))

    def writer(data: bytes) -> bool:
        barrier.wait()
        return store.put(digest, [data])

    with ThreadPoolExecutor(len(candidates)) as pool:
        won = list(pool.map(writer, candidates))
    assert won.count(True) == 1
    assert store.get(digest) == candidates[won.index(True)]


def test_reader_never_sees_a_partial_blob(store: BlobStore) -> None:
    digest, data = blob(3 << 20, -1)
    seen: list[int] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                got = store.get(digest)
            except NotFound:
                info = store.stat(digest)
                assert info is None or info.stored_size == len(data)
                continue
            seen.append(len(got))
            assert got == data
            return

    with ThreadPoolExecutor(2) as pool:
        readers = [pool.submit(reader) for _ in range(2)]
        time.sleep(0.01)
        try:
            assert store.put(digest, [data[: 1 << 20], data[1 << 20 :]])
            for r in readers:
                r.result(timeout=30)  # each returns once it has read the whole blob
        finally:
            stop.set()
    assert seen == [len(data), len(data)]


def test_local_iter_skips_temp_and_foreign_files(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    digest, data = blob(64, 5)
    store.put(digest, [data])
    fan = (tmp_path / "blobs" / blob_path(digest)).parent
    (fan / f".{digest.hex[2:]}.tmp123").write_bytes(data[:10])  # a writer mid-put
    (fan / "not-a-digest").write_bytes(b"x")
    assert [info.digest for info in store.iter()] == [digest]


def test_local_store_errors_are_unavailable_and_name_the_path(tmp_path: Path) -> None:
    # A directory where a file belongs (and a file where a directory does) stand in for
    # permission and I/O errors, which root does not get.
    store = LocalBlobStore(tmp_path / "blobs")
    digest, data = blob(64, 6)
    path = tmp_path / "blobs" / blob_path(digest)
    path.mkdir(parents=True)
    # What is not a regular file is no blob: reading it is an integrity failure (exit 4,
    # never a hang on a FIFO or an endless read of a device); deleting it fails as I/O.
    for call in (store.get, store.open):
        with pytest.raises(IntegrityError, match=f"{path} is a directory, not a regular") as e:
            call(digest)
        assert e.value.exit_code == 4
    with pytest.raises(Unavailable, match=f"blob {path}: Is a directory") as err:
        store.delete(digest)
    assert err.value.exit_code == 7
    other, data = blob(64, 7)
    fan = tmp_path / "blobs" / blob_path(other)
    fan.parent.write_bytes(b"")  # the fan-out directory is a file
    with pytest.raises(Unavailable, match=f"cannot write blob {fan}"):
        store.put(other, [data])
    with pytest.raises(Unavailable, match=f"cannot look at blob {fan}: Not a directory"):
        store.stat(other)
    # The stray file is no blob; the directory is listed, so gc tries it and reports it.
    assert [info.digest for info in store.iter()] == [digest]

"""Corrupt and hostile stored blobs, missing blobs and hostile KV files, against every blob
store: local, memory and the two real S3 servers (SeaweedFS and Ceph RGW), where a blob is
corrupted by overwriting its object with the raw S3 client, behind kvgraft's back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard

from kvgraft.blobstore import BlobStore, blob_path
from kvgraft.blobstore.local import LocalBlobStore
from kvgraft.blobstore.memory import MemoryBlobStore
from kvgraft.client import Registry
from kvgraft.codecs.codec import FRAME_VERSION, MAGIC, RawCodec, frame
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, InvalidKVFile, NotFound
from kvgraft.formats.manifest import ChunkRef
from tests.support.harness import RegistryFactory
from tests.support.hostile import CASES, HOSTILE
from tests.support.synthetic import write_synthetic

CLI = "from kvgraft.cli.main import main; main()"


def overwrite(store: BlobStore, digest: Digest, data: bytes) -> None:
    """Replace the stored bytes of `digest` the way a faulty disk or a careless operator
    would: kvgraft's own puts never overwrite."""
    if isinstance(store, LocalBlobStore):
        (store.root / blob_path(digest)).write_bytes(data)
    elif isinstance(store, MemoryBlobStore):
        store.corrupt(digest, data)
    else:
        from kvgraft.blobstore.s3 import S3BlobStore

        assert isinstance(store, S3BlobStore)
        store.client.put_object(Bucket=store.bucket, Key=store._key(digest), Body=data)
    assert store.get(digest) == data


def _header(codec: bytes, size: int) -> bytes:
    return MAGIC + bytes([FRAME_VERSION, len(codec)]) + codec + size.to_bytes(8, "little")


def _flip(stored: bytes, victim: ChunkRef, other: bytes) -> bytes:
    data = bytearray(stored)
    data[len(data) // 2] ^= 0x01
    return bytes(data)


# name -> (the hostile stored bytes, made from the victim's stored bytes, its reference and
# another blob's stored bytes; a substring of the reason verify and pull give)
Hostile = Callable[[bytes, ChunkRef, bytes], bytes]
STORED: dict[str, tuple[Hostile, str]] = {
    "bit-flip": (_flip, "is corrupt"),
    "truncated": (lambda s, v, o: s[: len(s) // 2], "is corrupt"),
    "empty": (lambda s, v, o: b"", "is corrupt"),
    "garbage": (lambda s, v, o: os.urandom(len(s)), "is corrupt"),
    "another-blob": (lambda s, v, o: o, "is corrupt"),
    "declared-bomb": (lambda s, v, o: _header(b"zstd", v.size * 1000) +
                      zstandard.ZstdCompressor().compress(bytes(v.size * 1000)),
                      "bytes, expected"),
    "hidden-bomb": (lambda s, v, o: _header(b"zstd", v.size) +
                    zstandard.ZstdCompressor().compress(bytes(v.size * 1000)),
                    "bytes, expected"),
    "unknown-codec": (lambda s, v, o: _header(b"lzma9", v.size) + b"...",
                      "unknown codec 'lzma9'"),
    "raw-of-other-content": (lambda s, v, o: b"".join(bytes(p) for p in frame(
        RawCodec(), bytes(v.size))), "is corrupt"),
}


def _pushed(make_registry: RegistryFactory, store_url: str,
            tmp_path: Path) -> tuple[Registry, ChunkRef, Path]:
    src = write_synthetic(tmp_path / "a.kv", tokens=600, window=100, sliding=[1])
    reg = make_registry(blob_url=store_url)
    digest = reg.push(src, "t/a").digest
    return reg, reg.manifest(digest).chunks[1], src


@pytest.mark.parametrize("case", sorted(STORED))
def test_hostile_stored_blob(make_registry: RegistryFactory, store_url: str, tmp_path: Path,
                             case: str) -> None:
    reg, victim, _ = _pushed(make_registry, store_url, tmp_path)
    other = reg.manifest(reg.resolve("t/a")).chunks[0].digest
    make, reason = STORED[case]
    overwrite(reg.store, victim.digest, make(reg.store.get(victim.digest), victim,
                                             reg.store.get(other)))
    (report,) = reg.verify("t/a")
    assert [b.digest for b in report.bad] == [victim.digest]
    assert reason in report.bad[0].reason
    fresh = make_registry(blob_url=store_url, cache_dir=tmp_path / "fresh-cache")
    out = tmp_path / "out" / "a.kv"
    with pytest.raises(IntegrityError, match=victim.digest.hex) as e:
        fresh.pull("t/a", out)
    assert e.value.exit_code == 4 and reason in e.value.message
    # Nothing unverified is left behind: no output, no temp file, no cache entry.
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
    assert not fresh.cache.has(victim.digest)


def test_missing_blob(make_registry: RegistryFactory, store_url: str, tmp_path: Path) -> None:
    reg, victim, _ = _pushed(make_registry, store_url, tmp_path)
    assert reg.store.delete(victim.digest)
    (report,) = reg.verify("t/a")
    assert [b.digest for b in report.bad] == [victim.digest]
    assert "missing" in report.bad[0].reason
    # Lost data the catalog promises: exit 4 for pull as for verify (3 is for names).
    with pytest.raises(IntegrityError, match=victim.digest.hex) as e:
        make_registry(blob_url=store_url, cache_dir=tmp_path / "c2").pull("t/a",
                                                                          tmp_path / "o.kv")
    assert e.value.exit_code == 4
    assert not (tmp_path / "o.kv").exists()


def test_hostile_kv_files_store_nothing(make_registry: RegistryFactory, store_url: str) -> None:
    reg = make_registry(blob_url=store_url)
    for name, (_, message) in sorted(CASES.items()):
        with pytest.raises(InvalidKVFile, match=message) as e:
            reg.push(HOSTILE / name, "t/hostile")
        assert e.value.exit_code == 4, name
    assert list(reg.store.iter()) == []
    assert reg.catalog.artifact_digests() == []
    with pytest.raises(NotFound):
        reg.resolve("t/hostile")


def test_cli_verify_names_the_corrupt_blob(any_s3_store_url: str, cli_env: dict[str, str],
                                           make_registry: RegistryFactory,
                                           tmp_path: Path) -> None:
    reg, victim, _ = _pushed(make_registry, any_s3_store_url, tmp_path)
    stored = bytearray(reg.store.get(victim.digest))
    stored[-1] ^= 0x80
    overwrite(reg.store, victim.digest, bytes(stored))
    env = {**cli_env, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")},
           "KVGRAFT_HOME": str(tmp_path / "home"), "KVGRAFT_BLOB_URL": any_s3_store_url}
    r = subprocess.run([sys.executable, "-c", CLI, "verify", "--all", "--json"], env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 4, r.stderr
    (line,) = r.stdout.splitlines()
    assert [b["digest"] for b in json.loads(line)["bad"]] == [str(victim.digest)]
    assert victim.digest.hex in r.stderr
    r = subprocess.run([sys.executable, "-c", CLI, "pull", "t/a", "-o",
                        str(tmp_path / "o.kv")], env={**env, "KVGRAFT_CACHE": str(tmp_path / "c")},
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 4 and victim.digest.hex in r.stderr, r.stderr
    assert not (tmp_path / "o.kv").exists()

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from kvgraft.blobstore.local import LocalBlobStore
from kvgraft.codecs.codec import MAGIC, parse_frame
from kvgraft.digest import Digest
from kvgraft.errors import IntegrityError, NotFound, UsageError
from kvgraft.formats.manifest import Manifest, file_tree
from kvgraft.transfer.push import PushOptions
from tests.support.harness import RegistryFactory
from tests.support.synthetic import write_synthetic


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
@pytest.mark.parametrize(("tokens", "chunk"), [(1, 256), (255, 256), (256, 256), (1000, 256),
                                               (777, 100), (40, 1)])
def test_round_trip_byte_exact(make_registry: RegistryFactory, tmp_path: Path, dtype: str,
                               tokens: int, chunk: int) -> None:
    src = write_synthetic(tmp_path / "a.kv", dtype=dtype, tokens=tokens, num_layers=3,
                          window=min(tokens, 37), sliding=[1])
    reg = make_registry()
    pushed = reg.push(src, "t/a:v1", options=PushOptions(chunk_tokens=chunk))
    out = tmp_path / "out" / "a.kv"
    pulled = reg.pull("t/a:v1", out)
    assert pulled.digest == pushed.digest
    assert sha(out) == sha(src)
    manifest = reg.manifest(pushed.digest)
    assert len(manifest.chunks) == -(-tokens // chunk)
    assert manifest.version == 2 and not manifest.tensors
    assert manifest.file_digest == file_tree(
        manifest.file_size, chunk, manifest.header.digest, manifest.tokens.digest,
        [c.digest for c in manifest.chunks])


def test_version_1_artifacts_push_pull_and_verify_as_before(
        make_registry: RegistryFactory, tmp_path: Path) -> None:
    # What older clients pushed: the file's SHA-256 and every tensor's in the manifest.
    src = write_synthetic(tmp_path / "a.kv", tokens=600, num_layers=2, window=100,
                          sliding=[1])
    reg = make_registry()
    v1 = reg.push(src, "t/a:v1", options=PushOptions(version=1)).digest
    v2 = reg.push(src, "t/a:v2").digest
    assert v1 != v2  # two manifests of one content
    old, new = reg.manifest(v1), reg.manifest(v2)
    assert old.version == 1 and old.file_digest.hex == sha(src)
    assert set(old.tensors) == {"token_ids", *(f"layers.{i}.{kv}" for i in range(2)
                                               for kv in ("key", "value"))}
    assert [c.digest for c in old.chunks] == [c.digest for c in new.chunks]  # shared blobs
    for tag in ("v1", "v2"):
        out = tmp_path / f"{tag}.kv"
        reg.pull(f"t/a:{tag}", out)
        assert sha(out) == sha(src)
        assert all(r.ok for r in reg.verify(f"t/a:{tag}"))


def test_a_version_2_file_digest_must_be_the_tree_of_its_blobs(
        make_registry: RegistryFactory, tmp_path: Path) -> None:
    reg = make_registry()
    digest = reg.push(write_synthetic(tmp_path / "a.kv", tokens=600), "t/a").digest
    doc = reg.manifest(digest).to_json()
    doc["file"]["digest"] = "sha256:" + sha(tmp_path / "a.kv")  # the v1 meaning
    with pytest.raises(IntegrityError, match="not the tree of its blobs"):
        Manifest.from_json(doc)
    doc = reg.manifest(digest).to_json()
    doc["tensors"] = {}
    with pytest.raises(IntegrityError, match="schema"):
        Manifest.from_json(doc)
    doc = reg.manifest(digest).to_json()
    doc["chunks"][0]["digest"] = doc["chunks"][1]["digest"]  # a chunk swapped: tree breaks
    with pytest.raises(IntegrityError, match="tree"):
        Manifest.from_json(doc)


def test_round_trip_every_store(make_registry: RegistryFactory, store_url: str,
                                tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=600, window=100, sliding=[0, 2])
    reg = make_registry(blob_url=store_url)
    digest = reg.push(src, "t/a").digest
    out = tmp_path / "b.kv"
    assert reg.pull("t/a", out).digest == digest
    assert sha(out) == sha(src)
    assert all(r.ok for r in reg.verify("t/a"))


def test_second_push_stores_nothing(make_registry: RegistryFactory,
                                    tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=600)
    reg = make_registry()
    first = reg.push(src, "t/a:1")
    again = reg.push(src, "t/a:2")
    assert first.digest == again.digest
    assert first.created and not again.created
    assert first.blobs_stored == 5 and again.blobs_stored == 0 and again.bytes_stored == 0


def _count_looks(monkeypatch: pytest.MonkeyPatch) -> list[Digest]:
    looked: list[Digest] = []
    real = LocalBlobStore.exists

    def exists(self: LocalBlobStore, digest: Digest) -> bool:
        looked.append(digest)
        return real(self, digest)

    monkeypatch.setattr(LocalBlobStore, "exists", exists)
    return looked


def test_push_stops_looking_for_chunks_after_the_first_new_one(
        make_registry: RegistryFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=1000)  # 4 chunks
    reg = make_registry()
    looked = _count_looks(monkeypatch)
    first = reg.push(src, "t/a:1", options=PushOptions(workers=1))
    chunks = reg.manifest(first.digest).chunks
    # Chunk 0 is new (chunk 1 may be looked for meanwhile, on the second thread): the later
    # ones are sent without a look.
    assert first.blobs_stored == 6
    assert not {chunks[2].digest, chunks[3].digest} & set(looked)

    # Chunk 2 is lost: a re-push finds 0 and 1, misses 2 and sends 3 without looking
    # first; 3, present after all, is refused by the create-only put, read back and kept.
    assert reg.store.delete(chunks[2].digest)
    again = reg.push(src, "t/a:2", options=PushOptions(workers=1))
    assert again.blobs_stored == 1 and again.bytes_stored > 0
    assert all(r.ok for r in reg.verify("t/a:2"))


def test_digest_is_independent_of_codec_level(make_registry: RegistryFactory,
                                              tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=300)
    a = make_registry(home=tmp_path / "h1").push(src, "t/a", options=PushOptions(level=1))
    b = make_registry(home=tmp_path / "h2").push(src, "t/a", options=PushOptions(level=9))
    c = make_registry(home=tmp_path / "h3").push(src, "t/a", options=PushOptions(codec="raw"))
    assert a.digest == b.digest == c.digest
    assert c.stored_size > a.stored_size


def test_chunk_tokens_change_the_digest(make_registry: RegistryFactory, tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "a.kv", tokens=300)
    reg = make_registry()
    assert reg.push(src, "t/a:x", options=PushOptions(chunk_tokens=100)).digest != \
        reg.push(src, "t/a:y", options=PushOptions(chunk_tokens=128)).digest


def test_shared_prefix_shares_chunk_blobs(make_registry: RegistryFactory, tmp_path: Path) -> None:
    # The same first 512 tokens with identical K/V bytes, then different continuations.
    ids = list(range(1000))
    a = write_synthetic(tmp_path / "a.kv", tokens=600, token_ids=ids[:600], seed=1)
    b = write_synthetic(tmp_path / "b.kv", tokens=600, token_ids=ids[:600], seed=1)
    reg = make_registry()
    ma = reg.manifest(reg.push(a, "t/a").digest)
    mb = reg.manifest(reg.push(b, "t/b").digest)
    assert ma.digest == mb.digest  # same content → same artifact, stored once
    assert [c.prefix for c in ma.chunks] == [c.prefix for c in mb.chunks]


def test_stored_blob_names_its_codec(make_registry: RegistryFactory, tmp_path: Path) -> None:
    reg = make_registry()
    digest = reg.push(write_synthetic(tmp_path / "a.kv"), "t/a").digest
    manifest = reg.manifest(digest)
    store = reg.store
    assert isinstance(store, LocalBlobStore)
    chunk_digests = {c.digest for c in manifest.chunks}
    for ref in manifest.blobs():
        stored = store.get(ref.digest)
        assert stored.startswith(MAGIC)
        name, size, _ = parse_frame(stored)
        # The default picks per blob: byte planes for float chunks, zstd for the rest.
        expected = "zstd-bytegroup" if ref.digest in chunk_digests else "zstd"
        assert (name, size) == (expected, ref.size)
    chunks = reg.inspect("t/a").to_json()["chunks"]
    assert all(c["codec"] == "zstd-bytegroup" and c["stored_size"] < c["size"] for c in chunks)




def test_missing_blob_is_reported(make_registry: RegistryFactory, tmp_path: Path) -> None:
    reg = make_registry()
    digest = reg.push(write_synthetic(tmp_path / "a.kv"), "t/a").digest
    victim = reg.manifest(digest).chunks[0].digest
    reg.store.delete(victim)
    assert "missing" in reg.verify("t/a")[0].bad[0].reason
    with pytest.raises(IntegrityError, match="missing from"):  # lost data: exit 4, as verify
        make_registry(cache_dir=tmp_path / "c2").pull("t/a", tmp_path / "o.kv")


def test_second_pull_transfers_nothing(make_registry: RegistryFactory, tmp_path: Path) -> None:
    reg = make_registry()
    reg.push(write_synthetic(tmp_path / "a.kv", tokens=600), "t/a")
    first = reg.pull("t/a", tmp_path / "1.kv")
    second = reg.pull("t/a", tmp_path / "2.kv")
    third = reg.pull("t/a")
    assert first.stats.fetched == 5 and first.stats.fetched_bytes > 0
    assert second.stats.fetched == 0 and second.stats.fetched_bytes == 0
    assert third.stats.fetched == 0
    assert sha(tmp_path / "1.kv") == sha(tmp_path / "2.kv")


def test_tampered_cache_entry_is_refetched(make_registry: RegistryFactory,
                                           tmp_path: Path) -> None:
    reg = make_registry()
    digest = reg.push(write_synthetic(tmp_path / "a.kv", tokens=600), "t/a").digest
    reg.pull("t/a")
    victim = reg.manifest(digest).chunks[0].digest
    cached = tmp_path / "home" / "cache" / "blobs" / "sha256" / victim.hex[:2] / victim.hex[2:]
    data = bytearray(cached.read_bytes())
    data[-1] ^= 0xFF
    cached.write_bytes(bytes(data))
    result = reg.pull("t/a", tmp_path / "b.kv")
    assert result.stats.fetched == 1
    assert sha(tmp_path / "b.kv") == sha(tmp_path / "a.kv")


def test_tag_untag_and_digest_refs(make_registry: RegistryFactory, tmp_path: Path) -> None:
    reg = make_registry()
    d1 = reg.push(write_synthetic(tmp_path / "a.kv", seed=1), "t/a:v1").digest
    d2 = reg.push(write_synthetic(tmp_path / "b.kv", seed=2), "t/a:v2").digest
    assert reg.tag("t/a:v1", "t/a:stable") == d1
    assert reg.resolve("t/a:stable") == d1
    reg.tag("t/a:v2", "t/a:stable")  # tags move
    assert reg.resolve("t/a:stable") == d2
    assert reg.resolve(f"t/a@{d1}") == d1
    assert reg.untag("t/a:v1") == d1
    with pytest.raises(NotFound):
        reg.resolve("t/a:v1")
    assert reg.resolve(f"t/a@{d1}") == d1  # untagged, still addressable by digest
    with pytest.raises(NotFound):
        reg.resolve(f"other/name@{d1}")  # digests resolve only in repositories that hold them
    with pytest.raises(NotFound):
        reg.untag("t/a:v1")
    with pytest.raises(UsageError):
        reg.push(tmp_path / "a.kv", f"t/a@{d1}")
    assert [t.tag for t in reg.list("t/*")] == ["stable", "v2"]
    assert reg.list("nomatch*") == ()


def test_labels_and_inspect(make_registry: RegistryFactory, tmp_path: Path) -> None:
    reg = make_registry()
    reg.push(write_synthetic(tmp_path / "a.kv", tokens=300), "t/a", labels={"task": "math"})
    info = reg.inspect("t/a").to_json()
    assert info["labels"] == {"task": "math"}
    assert info["size"] == sum(c["size"] for c in info["chunks"]) + \
        info["manifest"]["file"]["header"]["size"] + info["manifest"]["tokens"]["blob"]["size"]
    assert info["stored_size"] < info["size"]
    assert info["tags"] == ["t/a:latest"]
    Manifest.from_json(info["manifest"])


def test_push_that_dies_half_way_leaves_no_catalog_row(make_registry: RegistryFactory,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    reg = make_registry()
    src = write_synthetic(tmp_path / "a.kv", tokens=1000)
    calls = 0
    real_put = LocalBlobStore.put

    def failing_put(self: LocalBlobStore, digest: Digest, parts: list[bytes]) -> bool:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError("disk on fire")
        return real_put(self, digest, parts)

    monkeypatch.setattr(LocalBlobStore, "put", failing_put)
    with pytest.raises(OSError, match="disk on fire"):
        reg.push(src, "t/a")
    with pytest.raises(NotFound):
        reg.resolve("t/a")
    assert reg.catalog.artifact_digests() == []
    monkeypatch.setattr(LocalBlobStore, "put", real_put)
    result = reg.push(src, "t/a")  # a re-push completes it, reusing what was stored
    assert result.created and result.blobs_stored < 6
    assert all(r.ok for r in reg.verify("t/a"))






def test_parent_must_exist_and_is_recorded(make_registry: RegistryFactory,
                                           tmp_path: Path) -> None:
    reg = make_registry()
    parent = reg.push(write_synthetic(tmp_path / "p.kv", seed=1), "t/p").digest
    child = reg.push(write_synthetic(tmp_path / "c.kv", seed=2), "t/c",
                     options=PushOptions(parents=(parent,))).digest
    assert reg.manifest(child).parents == (parent,)
    with pytest.raises(NotFound):
        reg.push(tmp_path / "c.kv", "t/d", options=PushOptions(parents=(Digest("0" * 64),)))


def test_push_reads_the_file_in_bounded_memory(tmp_path: Path) -> None:
    # gather() reads only the chunk's slices: a file far bigger than a chunk stays on disk.
    from kvgraft.formats.chunks import gather, plan_chunks
    from kvgraft.formats.kvfile import read_layout

    src = write_synthetic(tmp_path / "a.kv", tokens=2048, num_layers=2)
    layout = read_layout(src)
    plans = plan_chunks(layout, 256)
    fd = os.open(src, os.O_RDONLY)
    try:
        buf = bytearray()
        sizes = {len(gather(fd, p, buf)) for p in plans}
    finally:
        os.close(fd)
    assert max(sizes) < layout.file_size / 7
    assert len(buf) == max(sizes)  # one reused buffer


@pytest.mark.parametrize("version", [1, 2])
def test_file_changed_during_push_is_refused(make_registry: RegistryFactory, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             version: int) -> None:
    # The header, the token ids and the chunks (in version 1 also the file digest) come
    # from several reads; a write in between must not publish a manifest whose blobs
    # rebuild some other file.
    import kvgraft.transfer.push as push_module
    from kvgraft.errors import InvalidKVFile

    reg = make_registry()
    src = write_synthetic(tmp_path / "a.kv", tokens=600)
    name = "hash_file" if version == 1 else "prefix_keys"
    real = getattr(push_module, name)

    def then_write(*args: Any) -> Any:
        result = real(*args)
        with open(src, "r+b") as f:
            f.seek(-16, os.SEEK_END)
            f.write(b"\x01" * 16)
        return result

    options = PushOptions(version=version)
    monkeypatch.setattr(push_module, name, then_write)
    with pytest.raises(InvalidKVFile, match="changed while it was being pushed"):
        reg.push(src, "t/a", options=options)
    assert reg.catalog.artifact_digests() == []
    monkeypatch.setattr(push_module, name, real)
    digest = reg.push(src, "t/a", options=options).digest  # once it holds still, it pushes
    reg.pull("t/a", tmp_path / "b.kv")
    assert sha(tmp_path / "b.kv") == sha(src)
    assert reg.manifest(digest).version == version


def test_file_truncated_during_push_is_an_integrity_error(
        make_registry: RegistryFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        cli_env: dict[str, str]) -> None:
    # Cut short after its header was read: the chunk reads come up short.
    import kvgraft.transfer.push as push_module
    from kvgraft.cli.main import cli
    from kvgraft.errors import InvalidKVFile
    from kvgraft.formats.kvfile import KVLayout, read_layout

    real = read_layout

    def read_then_truncate(path: str | Path) -> KVLayout:
        layout = real(path)
        os.truncate(path, layout.file_size // 2)
        return layout

    monkeypatch.setattr(push_module, "read_layout", read_then_truncate)
    reg = make_registry()
    src = write_synthetic(tmp_path / "a.kv", tokens=600)
    with pytest.raises(InvalidKVFile, match=f"{src} changed while it was being pushed"):
        reg.push(src, "t/a")
    assert reg.catalog.artifact_digests() == []
    reg.close()
    other = write_synthetic(tmp_path / "b.kv", tokens=600, seed=1)
    r = CliRunner(env=cli_env).invoke(cli, ["push", str(other), "t/b"])
    assert r.exit_code == 4, r.output
    assert f"{other} changed while it was being pushed" in r.stderr


def test_identical_chunks_are_fetched_once_and_written_everywhere(
        make_registry: RegistryFactory, tmp_path: Path) -> None:
    # One blob for many chunks: its decode buffer must stay alive until every place of it
    # is written, across batched writes.
    from kvgraft.formats.kvfile import RawTensor, write_kvfile
    from tests.support.synthetic import synthetic_identity

    heads, dim, tokens, chunk = 2, 8, 40 * 16, 16
    row = bytes(range(dim)) * 2  # BF16: dim values of 2 bytes, the same for every token
    data = row * (heads * tokens)
    layers = [(RawTensor("BF16", (heads, tokens, dim), data),
               RawTensor("BF16", (heads, tokens, dim), data), 0) for _ in range(2)]
    src = write_kvfile(tmp_path / "same.kv", layers, [7] * tokens, synthetic_identity("same"))
    reg = make_registry()
    digest = reg.push(src, "t/same", options=PushOptions(chunk_tokens=chunk)).digest
    manifest = reg.manifest(digest)
    assert len(manifest.chunks) == 40 and len({c.digest for c in manifest.chunks}) == 1
    pulled = reg.pull("t/same", tmp_path / "out.kv")
    assert sha(tmp_path / "out.kv") == sha(src)
    assert pulled.stats.fetched == 3  # header, tokens, the one chunk blob


def test_chunk_plans_cover_the_file_exactly_once(tmp_path: Path) -> None:
    import dataclasses

    from kvgraft.formats.chunks import plan_chunks, uncovered
    from kvgraft.formats.kvfile import read_layout

    layout = read_layout(write_synthetic(tmp_path / "a.kv", tokens=700, num_layers=3,
                                         window=90, sliding=[0, 2]))
    for chunk in (1, 7, 256, 700, 4096):
        assert uncovered(layout, plan_chunks(layout, chunk)) is None
    plans = plan_chunks(layout, 256)
    first = plans[0]
    dropped = [dataclasses.replace(first, runs=first.runs[1:]), *plans[1:]]
    assert "covered by no blob" in str(uncovered(layout, dropped))
    doubled = [dataclasses.replace(first, runs=first.runs + first.runs[:1]), *plans[1:]]
    assert "written twice" in str(uncovered(layout, doubled))
    assert "cover" in str(uncovered(layout, plans[:-1]))


def test_manifest_plans_check_the_manifest_against_its_header(
        make_registry: RegistryFactory, tmp_path: Path) -> None:
    # The one check pull and the transformers loader both make before placing any chunk.
    import dataclasses

    from kvgraft.formats.chunks import manifest_plans, plan_chunks
    from kvgraft.formats.kvfile import read_layout

    src = write_synthetic(tmp_path / "a.kv", tokens=700, num_layers=3, window=90, sliding=[1])
    reg = make_registry()
    manifest = reg.manifest(reg.push(src, "t/a", options=PushOptions(chunk_tokens=256)).digest)
    layout = read_layout(src)
    assert manifest_plans(manifest, layout) == plan_chunks(layout, 256)
    last = manifest.chunks[-1]
    resized = dataclasses.replace(
        manifest, chunks=(*manifest.chunks[:-1], dataclasses.replace(last, size=last.size + 2)))
    with pytest.raises(IntegrityError, match="chunks do not match its header"):
        manifest_plans(resized, layout)
    longer = dataclasses.replace(layout, file_size=layout.file_size + 8)
    with pytest.raises(IntegrityError, match="cannot be rebuilt: the blobs cover"):
        manifest_plans(manifest, longer)


@pytest.mark.parametrize("version", [1, 2])
def test_an_assembled_graft_kept_in_the_cache_is_checked_on_every_read(
        make_registry: RegistryFactory, tmp_path: Path, version: int) -> None:
    # Engines read a graft through read_kv: the first read assembles and keeps the file,
    # later ones map the kept copy and verify it chunk by chunk, whatever the version.
    from kvgraft.transfer.materialise import read_kv

    src = write_synthetic(tmp_path / "a.kv", tokens=600, window=100, sliding=[1])
    want = src.read_bytes()
    reg = make_registry()
    reg.push(src, "t/a", options=PushOptions(version=version))
    opened = reg.open("t/a")

    def read() -> bytes:
        layout, buf, base = read_kv(opened.manifest, opened.fetcher)
        return bytes(memoryview(buf)[base : base + layout.file_size])

    assert read() == want  # assembled from the chunks
    kept = reg.cache.blobs._path(opened.manifest.file_digest)
    assert read() == want  # the kept copy, verified
    raw = bytearray(kept.read_bytes())
    raw[-20] ^= 1  # tamper with the kept copy (the token ids)
    kept.chmod(0o644)
    kept.write_bytes(bytes(raw))
    assert read() == want  # refused, rebuilt from the chunks
    raw = bytearray(kept.read_bytes())
    raw[len(raw) // 2] ^= 1  # and inside a chunk's KV
    kept.write_bytes(bytes(raw))
    assert read() == want
    assert read_filled(opened, want) == 1  # the rebuilt copy kept, verified
    raw[len(raw) // 2] ^= 1 << 1
    kept.write_bytes(bytes(raw))
    assert read_filled(opened, want) == 2  # the kept copy refused: filled again, rebuilt


def read_filled(opened: Any, want: bytes) -> int:
    """read_kv with a filler that checks each range it is told is verified is there and
    that every chunk is told once for the buffer read_kv returns; how many buffers it saw."""
    from kvgraft.formats.kvfile import KVLayout
    from kvgraft.transfer.materialise import KVBuffer, read_kv

    told: list[tuple[KVBuffer, int, list[tuple[int, int]]]] = []

    def fill(layout: KVLayout, buf: KVBuffer, base: int) -> Callable[[int, int], None]:
        key = layout.layers[0].key
        heads, tokens, dim = key.shape
        mine: list[tuple[int, int]] = []
        told.append((buf, base, mine))

        def rows(data: Any, at: int, start: int, end: int) -> bytes:
            flat = np.frombuffer(data, np.uint8, count=key.nbytes, offset=at + key.begin)
            return flat.reshape(heads, tokens, dim * key.itemsize)[:, start:end].tobytes()

        def verified(start: int, end: int) -> None:
            assert rows(buf, base, start, end) == rows(want, 0, start, end)
            mine.append((start, end))

        return verified

    layout, buf, base = read_kv(opened.manifest, opened.fetcher, fill=fill)
    assert bytes(memoryview(buf)[base : base + layout.file_size]) == want
    assert told[-1][0] is buf and told[-1][1] == base
    assert sorted(told[-1][2]) == [(c.start, c.end) for c in opened.manifest.chunks]
    return len(told)


def test_kept_chunk_plans_are_bounded_by_their_runs(make_registry: RegistryFactory,
                                                    tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # read_kv keeps each manifest's layout and chunk plans, least recently used out first,
    # within a number of runs; a manifest larger than that is planned every time.
    from kvgraft.transfer import materialise

    reg = make_registry()
    opened = []
    for i, tokens in enumerate((200, 200, 900)):  # 1, 1 and 4 chunks
        src = write_synthetic(tmp_path / f"{i}.kv", tokens=tokens, seed=i)
        reg.push(src, f"t/p{i}")
        opened.append((reg.open(f"t/p{i}"), src.read_bytes()))
    runs = [sum(len(p.runs) for p in materialise._plan(o.manifest, o.fetcher)[1])
            for o, _ in opened]
    monkeypatch.setattr(materialise, "_PLANNED", OrderedDict())
    monkeypatch.setattr(materialise, "_planned_runs", 0)
    monkeypatch.setattr(materialise, "_PLANNED_MAX_RUNS", runs[0] + runs[1])

    def kept() -> list[int]:
        return [i for i, (o, _) in enumerate(opened)
                if (o.manifest.digest, o.manifest.header.digest) in materialise._PLANNED]

    def read(i: int) -> None:
        o, want = opened[i]
        layout, buf, base = materialise.read_kv(o.manifest, o.fetcher)
        assert bytes(memoryview(buf)[base : base + layout.file_size]) == want

    read(0)
    read(1)
    assert kept() == [0, 1]
    read(0)  # used again: 1 is now the least recently used
    read(2)  # larger than 0 and 1 together: not kept, nothing evicted for it
    assert kept() == [0, 1] and materialise._planned_runs == runs[0] + runs[1]
    monkeypatch.setattr(materialise, "_PLANNED_MAX_RUNS", runs[0] + runs[2])
    read(2)  # kept: 1 goes first, then 0 still fits
    assert kept() == [0, 2] and materialise._planned_runs == runs[0] + runs[2]
    for i in range(3):
        read(i)

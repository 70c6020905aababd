"""Unlucky and hostile conditions: a damaged catalog, special files, corrupted blobs,
colliding references, killed writers. Each test reproduces a defect and checks the data
survives it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.synthetic import write_synthetic


def run(env: dict[str, str], *args: str, timeout: float = 120,
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def blob_files(home: Path) -> list[Path]:
    return sorted(p for p in (home / "blobs" / "sha256").glob("*/*")
                  if not p.name.startswith("."))


@pytest.fixture
def pushed(cli_env: dict[str, str], tmp_path: Path) -> Path:
    """A home whose catalog and store hold one pushed artifact; returns the KV file."""
    src = write_synthetic(tmp_path / "a.kv", tokens=300)
    r = run(cli_env, "push", str(src), "faults/a:v1")
    assert r.returncode == 0, r.stderr
    return src


# --- the catalog never silently resets ---------------------------------------------------

@pytest.mark.parametrize("damage", ["empty", "garbage", "torn"])
def test_damaged_catalog_is_an_error_not_a_reset(
        cli_env: dict[str, str], tmp_path: Path, pushed: Path, damage: str) -> None:
    home = tmp_path / "home"
    db = home / "catalog.db"
    run(cli_env, "ls")  # leaves the WAL checkpointed into catalog.db on close
    blobs = blob_files(home)
    assert blobs
    if damage == "empty":
        db.write_bytes(b"")
    elif damage == "garbage":
        db.write_bytes(b"\x00garbage" * 512)
    else:  # a valid header, the pages after it overwritten
        raw = bytearray(db.read_bytes())
        raw[100:] = b"\xff" * (len(raw) - 100)
        db.write_bytes(bytes(raw))
    for args in (["ls"], ["gc", "--grace", "0s"], ["push", str(pushed), "faults/a:v2"]):
        r = run(cli_env, *args)
        assert r.returncode == 7, (args, r.stderr)
        assert "catalog" in r.stderr and "backup" in r.stderr, r.stderr
        assert "internal error" not in r.stderr
    assert db.stat().st_size == (0 if damage == "empty" else db.stat().st_size)
    assert blob_files(home) == blobs  # nothing deleted


def test_missing_catalog_is_created(cli_env: dict[str, str], tmp_path: Path) -> None:
    db = tmp_path / "home" / "catalog.db"
    r = run(cli_env, "ls")  # listing a registry never written to does not create it
    assert r.returncode == 0 and not db.exists(), r.stderr
    r = run(cli_env, "db", "upgrade")
    assert r.returncode == 0, r.stderr
    assert db.read_bytes()[:16] == b"SQLite format 3\x00"
    assert not [p for p in db.parent.iterdir() if p.name.endswith(".tmp")]


def test_gc_refuses_empty_catalog_in_front_of_full_store(
        cli_env: dict[str, str], tmp_path: Path, pushed: Path) -> None:
    home = tmp_path / "home"
    blobs = blob_files(home)
    # The catalog is lost and a new one made (moved aside, as the error hint says).
    for p in home.glob("catalog.db*"):
        p.rename(p.with_name("old-" + p.name))
    r = run(cli_env, "gc", "--grace", "0s")
    assert r.returncode == 6, r.stderr
    assert "--allow-empty-catalog" in r.stderr
    assert blob_files(home) == blobs
    r = run(cli_env, "gc", "--grace", "0s", "--dry-run")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == len(blobs)
    r = run(cli_env, "gc", "--grace", "0s", "--allow-empty-catalog")
    assert r.returncode == 0, r.stderr
    assert blob_files(home) == []


# --- bounded reads; special files refused, not read ----------------------------------------

@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_user_inputs_that_are_special_files_are_refused(
        cli_env: dict[str, str], tmp_path: Path, fifo: Path, special: str) -> None:
    path = str(fifo) if special == "fifo" else special
    for args in (["trust", "add", path], ["push", path, "faults/x:v1"]):
        r = run(cli_env, *args, timeout=60)  # a FIFO used to block forever here
        assert r.returncode == 2, (args, r.stderr)
        assert "not a regular file" in r.stderr
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").symlink_to(path)
    r = run(cli_env, "--remote", "x", "ls", timeout=60)
    assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr


def test_oversized_key_file_is_refused(cli_env: dict[str, str], tmp_path: Path) -> None:
    big = tmp_path / "big.pub"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: a read of it would take a GiB of memory
    r = run(cli_env, "trust", "add", str(big))
    assert r.returncode == 2 and "more than" in r.stderr, r.stderr


def test_store_blob_replaced_by_device_or_huge_file(
        cli_env: dict[str, str], tmp_path: Path, pushed: Path) -> None:
    home = tmp_path / "home"
    blobs = blob_files(home)
    small = min(blobs, key=lambda p: p.stat().st_size)
    other = max(blobs, key=lambda p: p.stat().st_size)
    small.unlink()
    small.symlink_to("/dev/zero")
    other.unlink()
    with open(other, "wb") as f:
        f.truncate(1 << 30)
    r = run(cli_env, "verify", "--all")
    assert r.returncode == 4, r.stderr
    assert "character device" in r.stdout + r.stderr
    assert "at most" in r.stdout + r.stderr
    r = run(cli_env, "pull", "faults/a:v1", "-o", str(tmp_path / "out.kv"))
    assert r.returncode == 4, r.stderr
    assert not (tmp_path / "out.kv").exists()


def test_cache_blob_replaced_by_device_is_fetched_again(
        cli_env: dict[str, str], tmp_path: Path, pushed: Path) -> None:
    r = run(cli_env, "pull", "faults/a:v1", "-o", str(tmp_path / "one.kv"))
    assert r.returncode == 0, r.stderr
    cached = sorted(p for p in (tmp_path / "cache" / "blobs" / "sha256").glob("*/*"))
    assert cached
    for p in cached:
        p.unlink()
        p.symlink_to("/dev/zero")
    r = run(cli_env, "pull", "faults/a:v1", "-o", str(tmp_path / "two.kv"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "two.kv").read_bytes() == pushed.read_bytes()
    assert not any(p.is_symlink() for p in cached)


def test_s3_blob_replaced_by_larger_object_is_not_downloaded(s3_store_url: str) -> None:
    from kvgraft.blobstore.s3 import S3BlobStore
    from kvgraft.codecs.codec import RawCodec, frame, max_stored_size
    from kvgraft.digest import Digest
    from kvgraft.errors import IntegrityError

    store = S3BlobStore.from_url(s3_store_url)
    data = b"a small header blob"
    digest = Digest.of(data)
    assert store.put(digest, frame(RawCodec(), data))
    huge = b"\0" * (8 << 20)
    store.client.put_object(Bucket=store.bucket, Key=store._key(digest), Body=huge)
    with pytest.raises(IntegrityError, match="at most"):
        store.get(digest, max_stored_size(len(data)))


# --- a push is done or not ---------------------------------------------------------------

def test_references_sharing_a_prefix_do_not_collide_in_the_cache(
        cli_env: dict[str, str], tmp_path: Path, pushed: Path) -> None:
    # The old layout's refs/coll/b (a file) is still there from an older kvgraft.
    old = tmp_path / "cache" / "refs" / "coll" / "b"
    old.parent.mkdir(parents=True)
    old.write_text("sha256:" + "0" * 64)
    for ref in ("coll:b", "coll/b:c", "coll/b/c:d"):
        r = run(cli_env, "push", str(pushed), ref)
        assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    offline = {**cli_env, "KVGRAFT_OFFLINE": "1"}
    for env in (cli_env, offline):  # the second round from the cache's references alone
        for ref in ("coll:b", "coll/b:c", "coll/b/c:d"):
            out = tmp_path / f"{ref.replace('/', '_')}.kv"
            r = run(env, "pull", ref, "-o", str(out))
            assert r.returncode == 0 and "warning" not in r.stderr, (ref, r.stderr)
            assert out.read_bytes() == pushed.read_bytes()
    r = run(cli_env, "cache", "prune")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "cache" / "refs").exists()


def test_cache_failure_after_the_commit_is_a_warning(
        cli_env: dict[str, str], tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "b.kv", tokens=200, seed=3)
    cache = tmp_path / "cache"
    cache.mkdir()
    # Writes under these fail whoever runs the test (root ignores permissions).
    (cache / "tags").write_text("not a directory")
    (cache / "manifests").write_text("not a directory")
    r = run(cli_env, "push", str(src), "faults/b:v1")
    assert r.returncode == 0, r.stderr
    assert "warning: caching faults/b:v1 failed" in r.stderr
    r = run(cli_env, "ls", "--json")
    assert '"faults/b"' in r.stdout


# --- repair ------------------------------------------------------------------------------

def corrupt(store: object, digest: object, data: bytes) -> None:
    """Replace a stored blob's bytes behind the store's back, on any backend."""
    from kvgraft.blobstore.local import LocalBlobStore
    from kvgraft.blobstore.memory import MemoryBlobStore
    from kvgraft.blobstore.s3 import S3BlobStore
    from kvgraft.digest import Digest

    assert isinstance(digest, Digest)
    if isinstance(store, MemoryBlobStore):
        store.corrupt(digest, data)
    elif isinstance(store, S3BlobStore):
        store.client.put_object(Bucket=store.bucket, Key=store._key(digest), Body=data)
    else:
        assert isinstance(store, LocalBlobStore)
        path = store._path(digest)
        path.unlink()
        path.write_bytes(data)


@pytest.fixture
def repo(make_registry: object, store_url: str, tmp_path: Path) -> object:
    reg = make_registry(blob_url=store_url)  # type: ignore[operator]
    yield reg
    reg.close()


def test_push_again_repairs_a_corrupt_blob(repo: object, tmp_path: Path) -> None:
    from kvgraft.client import Registry

    reg = repo
    assert isinstance(reg, Registry)
    src = write_synthetic(tmp_path / "r.kv", tokens=600, seed=11)
    first = reg.push(src, "faults/r:v1")
    m = reg.manifest(first.digest)
    victims = [m.chunks[0].digest, m.header.digest]
    stored = reg.store.get(victims[0])
    corrupt(reg.store, victims[0], stored[:-1] + bytes([stored[-1] ^ 1]))  # one bit
    corrupt(reg.store, victims[1], b"garbage")
    assert {b.digest for b in reg.verify("faults/r:v1")[0].bad} == set(victims)
    again = reg.push(src, "faults/r:v1")
    assert again.blobs_stored == 2 and again.bytes_stored > 0
    assert reg.verify("faults/r:v1")[0].ok  # catalog rows describe the new objects too
    out = tmp_path / "out.kv"
    reg.pull("faults/r:v1", out)
    assert out.read_bytes() == src.read_bytes()


def test_verify_repair_from_cache_and_from_file(
        cli_env: dict[str, str], tmp_path: Path, pushed: Path) -> None:
    home = tmp_path / "home"
    r = run(cli_env, "pull", "faults/a:v1")  # fills the cache
    assert r.returncode == 0, r.stderr
    for source in (["--repair"], ["--repair-from", str(pushed)]):
        blobs = blob_files(home)
        blobs[0].unlink()
        blobs[0].symlink_to("/dev/zero")
        blobs[1].write_bytes(b"KVGB garbage")
        r = run(cli_env, "verify", "faults/a:v1")
        assert r.returncode == 4, r.stderr
        r = run(cli_env, "verify", "faults/a:v1", *source)
        assert r.returncode == 0, (source, r.stderr)
        assert "repaired 2 of 2" in r.stderr
        assert not blobs[0].is_symlink()
    other = write_synthetic(tmp_path / "other.kv", tokens=100, seed=4)
    blob_files(home)[0].write_bytes(b"bad")
    r = run(cli_env, "verify", "faults/a:v1", "--repair-from", str(other))
    assert r.returncode == 2 and "is not the file of artifact" in r.stderr, r.stderr


# --- timeouts on stalled endpoints ----------------------------------------------------------

@pytest.fixture
def silent_server() -> object:
    """A TCP server that accepts connections and never answers."""
    import socket
    import threading

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.5)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield sock.getsockname()[1]
    stop.set()
    t.join()
    for c in held:
        c.close()
    sock.close()


@pytest.mark.slow
def test_stalled_s3_endpoint_fails_within_a_minute(
        cli_env: dict[str, str], tmp_path: Path, silent_server: int) -> None:
    import time

    src = write_synthetic(tmp_path / "s.kv", tokens=100)
    env = {**cli_env, "KVGRAFT_BLOB_URL": "s3://stalled/x",
           "KVGRAFT_S3_ENDPOINT_URL": f"http://127.0.0.1:{silent_server}",
           "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for k in ("AWS_MAX_ATTEMPTS", "KVGRAFT_S3_READ_TIMEOUT", "KVGRAFT_S3_CONNECT_TIMEOUT"):
        env.pop(k, None)
    start = time.monotonic()
    r = run(env, "push", str(src), "faults/s:v1", timeout=120)  # the defaults
    took = time.monotonic() - start
    assert r.returncode == 7, r.stderr
    assert took < 60, took
    assert f"127.0.0.1:{silent_server}" in r.stderr.splitlines()[-1]
    assert "retrying (attempt 2 of 4)" in r.stderr
    env.update(KVGRAFT_S3_READ_TIMEOUT="0.5", AWS_MAX_ATTEMPTS="1")
    start = time.monotonic()
    r = run(env, "push", str(src), "faults/s:v1", timeout=120)
    assert r.returncode == 7 and time.monotonic() - start < 15, r.stderr
    assert "retrying" not in r.stderr


def test_stalled_postgres_catalog_fails_in_seconds(silent_server: int) -> None:
    import time

    from kvgraft.catalog import Catalog
    from kvgraft.errors import Unavailable

    start = time.monotonic()
    with pytest.raises(Unavailable, match="unavailable"):
        Catalog.open(f"postgresql+psycopg://u@127.0.0.1:{silent_server}/db")  # the default
    assert time.monotonic() - start < 30


def test_s3_timeouts_from_env() -> None:
    from kvgraft.blobstore.s3settings import S3Settings
    from kvgraft.errors import UsageError

    s = S3Settings.from_env({"KVGRAFT_S3_CONNECT_TIMEOUT": "2.5", "KVGRAFT_S3_READ_TIMEOUT": "30"})
    config = s.botocore_config()
    options = vars(config)  # botocore-stubs declare no attributes for Config's options
    assert (options["connect_timeout"], options["read_timeout"]) == (2.5, 30.0)
    for bad in ("x", "0", "-1", "nan", "1e9"):
        with pytest.raises(UsageError, match="KVGRAFT_S3_READ_TIMEOUT"):
            S3Settings.from_env({"KVGRAFT_S3_READ_TIMEOUT": bad})


# --- output files ------------------------------------------------------------------------

def test_pull_refuses_to_write_over_special_files(
        cli_env: dict[str, str], tmp_path: Path, pushed: Path, fifo: Path) -> None:
    import stat

    targets = [fifo]
    dev = tmp_path / "null"
    try:  # a /dev/null of our own (needs CAP_MKNOD); never the system's
        os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        targets.append(dev)
    except PermissionError:
        pass
    for target in targets:
        link = tmp_path / f"link-to-{target.name}"
        link.symlink_to(target)
        for out in (target, link):
            r = run(cli_env, "pull", "faults/a:v1", "-o", str(out))
            assert r.returncode == 2, r.stderr
            assert "refusing to write over" in r.stderr
        mode = target.stat().st_mode
        assert stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_pull_through_a_symlink_replaces_its_target(
        cli_env: dict[str, str], tmp_path: Path, pushed: Path) -> None:
    real = tmp_path / "real.kv"
    real.write_bytes(b"old")
    link = tmp_path / "link.kv"
    link.symlink_to(real)
    dangling = tmp_path / "dangling.kv"
    dangling.symlink_to(tmp_path / "new.kv")
    for out in (link, dangling):
        r = run(cli_env, "pull", "faults/a:v1", "-o", str(out))
        assert r.returncode == 0, r.stderr
        assert out.is_symlink() and out.read_bytes() == pushed.read_bytes()
    assert real.read_bytes() == pushed.read_bytes()


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_pulled_file_honours_the_umask(
        cli_env: dict[str, str], tmp_path: Path, pushed: Path, umask: int) -> None:
    out = tmp_path / "out.kv"
    r = subprocess.run([sys.executable, "-m", "kvgraft.cli", "pull", "faults/a:v1", "-o",
                        str(out)], env=cli_env, capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: os.umask(umask))
    assert r.returncode == 0, r.stderr
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    out.chmod(0o640)  # an existing file keeps its mode
    r = run(cli_env, "pull", "faults/a:v1", "-o", str(out))
    assert r.returncode == 0 and out.stat().st_mode & 0o777 == 0o640


def test_stale_temp_files_are_swept(cli_env: dict[str, str], tmp_path: Path,
                                    pushed: Path) -> None:
    home = tmp_path / "home"
    old = time_ago(3 * 3600)
    fan = blob_files(home)[0].parent
    stale = [fan / ".deadbeef.abc123.tmp", tmp_path / ".out.kv.x1y2z3.tmp",
             tmp_path / "cache" / "blobs" / ".z.q.tmp"]
    fresh = [fan / ".cafe.def456.tmp", tmp_path / ".out.kv.fresh.tmp"]
    for p in stale + fresh:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"partial")
    for p in stale:
        os.utime(p, (old, old))
    other = tmp_path / ".other.kv.a.tmp"  # another output's temp file: not ours to touch
    other.write_bytes(b"x")
    os.utime(other, (old, old))
    assert run(cli_env, "pull", "faults/a:v1", "-o", str(tmp_path / "out.kv")).returncode == 0
    assert run(cli_env, "gc").returncode == 0
    assert run(cli_env, "cache", "prune").returncode == 0
    assert [p.exists() for p in stale] == [False] * len(stale)
    assert all(p.exists() for p in fresh) and other.exists()


def time_ago(seconds: float) -> float:
    import time

    return time.time() - seconds


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_killed_pull_leaves_no_temp_file(cli_env: dict[str, str], tmp_path: Path,
                                         signame: str) -> None:
    import signal
    import time

    src = write_synthetic(tmp_path / "big.kv", num_layers=16, kv_heads=4, head_dim=128,
                          tokens=3000, seed=2)  # ~50 MB: a pull long enough to interrupt
    assert run(cli_env, "push", str(src), "faults/big:v1").returncode == 0
    out = tmp_path / "out" / "big.kv"
    out.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "kvgraft.cli", "pull", "faults/big:v1",
                             "-o", str(out)], env=cli_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(out.parent.glob(".big.kv.*.tmp")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    if proc.poll() is not None:
        pytest.skip("the pull finished before it could be interrupted")
    sig = getattr(signal, signame)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr
    assert f"terminated by {signame}" in stderr
    assert list(out.parent.iterdir()) == []

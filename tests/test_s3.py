"""S3-specific behaviour of the blob store, against a real S3 server on loopback (and, for
retries and unreachable endpoints, small HTTP servers that misbehave on purpose)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import os
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from email.utils import formatdate
from typing import TYPE_CHECKING, Any

import pytest

from kvgraft.blobstore import open_store
from kvgraft.blobstore.s3 import S3BlobStore
from kvgraft.blobstore.s3settings import MiB, S3Settings
from kvgraft.digest import Digest
from kvgraft.errors import MissingExtra, NotFound, Unavailable, UsageError
from tests.support.daemons import free_ports

if TYPE_CHECKING:
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef


def split(url: str) -> tuple[str, str]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix


@pytest.fixture
def store(any_s3_store_url: str) -> S3BlobStore:
    return S3BlobStore.from_url(any_s3_store_url)


@pytest.fixture
def small_parts(any_s3_store_url: str) -> S3BlobStore:
    """A store that goes multipart from 5 MiB (the S3 minimum part size)."""
    bucket, prefix = split(any_s3_store_url)
    return S3BlobStore(bucket, prefix, settings=S3Settings(
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL_S3"), addressing="path",
        multipart_threshold=5 * MiB, part_size=5 * MiB, concurrency=4))


def test_existing_object_wins_over_put(store: S3BlobStore) -> None:
    """A racing writer that got there first (here: another client) is never overwritten;
    the conditional create's 412 is what tells us, not a look beforehand."""
    data = b"stored by someone else"
    digest = Digest.of(b"decoded content")
    store.client.put_object(Bucket=store.bucket, Key=store._key(digest), Body=data)
    assert store.put(digest, [b"our encoding"]) is False
    assert store.get(digest) == data


def test_multipart_blob(small_parts: S3BlobStore) -> None:
    store = small_parts
    data = os.urandom(23 * MiB + 123)
    digest = Digest.of(data)
    sizes: list[int | None] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            info = store.stat(digest)
            sizes.append(None if info is None else info.stored_size)
            time.sleep(0.005)

    with ThreadPoolExecutor(1) as pool:
        watcher = pool.submit(watch)
        try:
            assert store.put(digest, [data[:1000], memoryview(data)[1000:]]) is True
        finally:
            done.set()
        watcher.result()
    # While the parts went up the object did not exist; then it appeared whole.
    assert set(sizes) <= {None, len(data)}
    head = store.client.head_object(Bucket=store.bucket, Key=store._key(digest))
    assert head["ETag"].endswith('-4"')  # 5 + 5 + 5 + the last part absorbing the remainder
    assert store.get(digest) == data  # ranged GETs in parallel after the first part
    with store.open(digest) as f:
        assert f.read() == data
    # A second writer's multipart upload loses on CompleteMultipartUpload and is aborted.
    assert store.put(digest, [os.urandom(len(data))]) is False
    assert store.get(digest) == data
    uploads = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    assert uploads.get("Uploads", []) == []


def test_multipart_racing_writers(small_parts: S3BlobStore) -> None:
    digest = Digest.of(b"big content")
    candidates = [bytes([i]) * (11 * MiB) for i in range(3)]
    barrier = threading.Barrier(len(candidates))

    def writer(data: bytes) -> bool:
        barrier.wait()
        return small_parts.put(digest, [data])

    with ThreadPoolExecutor(len(candidates)) as pool:
        won = list(pool.map(writer, candidates))
    # SeaweedFS 4.48 does not make two conditional CompleteMultipartUpload calls atomic:
    # in a narrow window two writers can both be told they created the object. What must
    # hold on any server is that someone won and the object is one writer's whole content.
    assert won.count(True) >= 1
    assert small_parts.get(digest) in [c for c, w in zip(candidates, won, strict=True) if w]


# What the two servers do differently with the S3 features kvgraft uses (docs/deploy.md
# lists them): a change here is a change to document.
SERVER_BEHAVIOUR = {
    "s3": {"validates_sha256": True, "returns_sha256": True, "complete_etag": True,
           "part_number_head": True, "validates_payload_hash": False},
    "ceph": {"validates_sha256": False, "returns_sha256": False, "complete_etag": False,
             "part_number_head": False, "validates_payload_hash": True},
}


def test_server_behaviour(any_s3_store_url: str, request: pytest.FixtureRequest) -> None:
    import base64
    import hashlib

    import botocore.exceptions

    expected = SERVER_BEHAVIOUR[request.node.callspec.params["any_s3_store_url"]]
    store = S3BlobStore.from_url(any_s3_store_url)
    c, bucket, key = store.client, store.bucket, f"{store.prefix}/probe"
    wrong = base64.b64encode(hashlib.sha256(b"other bytes").digest()).decode()
    try:
        c.put_object(Bucket=bucket, Key=key, Body=b"data", ChecksumSHA256=wrong)
        validates = False
    except botocore.exceptions.ClientError as e:
        assert e.response["Error"]["Code"] == "BadDigest"
        validates = True
    put = c.put_object(Bucket=bucket, Key=key + "2", Body=b"data", ChecksumAlgorithm="SHA256")
    # Conditional creates work on both: kvgraft's first-writer-wins rests on them.
    with pytest.raises(botocore.exceptions.ClientError, match="PreconditionFailed"):
        c.put_object(Bucket=bucket, Key=key + "2", Body=b"x", IfNoneMatch="*")
    upload = c.create_multipart_upload(Bucket=bucket, Key=key + "3")["UploadId"]
    parts: list[CompletedPartTypeDef] = [{"PartNumber": n, "ETag": c.upload_part(
        Bucket=bucket, Key=key + "3", UploadId=upload, PartNumber=n,
        Body=bytes([n]) * (5 * MiB))["ETag"]} for n in (1, 2)]
    done = c.complete_multipart_upload(Bucket=bucket, Key=key + "3", UploadId=upload,
                                       MultipartUpload={"Parts": parts}, IfNoneMatch="*")
    head = c.head_object(Bucket=bucket, Key=key + "3")
    assert head["ETag"].endswith('-2"')  # the object's own ETag is there on both
    part = c.head_object(Bucket=bucket, Key=key + "3", PartNumber=1)
    # A body damaged after signing, with no checksum header: only the SigV4 payload hash
    # (x-amz-content-sha256, signed over plain http) can reveal it.
    bare = boto3_client_without_checksums()
    _corrupt_bodies_in_transit(bare)
    try:
        bare.put_object(Bucket=bucket, Key=key + "4", Body=b"data" * 1000)
        payload_checked = False
    except botocore.exceptions.ClientError:
        payload_checked = True
    assert {"validates_sha256": validates, "returns_sha256": "ChecksumSHA256" in put,
            "complete_etag": bool(done.get("ETag")),
            "part_number_head": part["ContentLength"] == 5 * MiB,
            "validates_payload_hash": payload_checked} == expected


def boto3_client_without_checksums() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client("s3", config=Config(
        s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
        retries={"total_max_attempts": 1}))


def _corrupt_bodies_in_transit(client: Any) -> list[str]:
    """Flip one byte of every PutObject / UploadPart body after the request is signed (and
    any checksum computed): what a bad NIC, proxy or memory on the way does. Returns the
    operations it corrupted."""
    corrupted: list[str] = []

    def corrupt(request: Any, event_name: str, **_: Any) -> None:
        body = request.body
        data = bytearray(body.read() if hasattr(body, "read") else body)
        if hasattr(body, "seek"):
            body.seek(0)
        data[len(data) // 2] ^= 0x01
        request.body = bytes(data)
        corrupted.append(event_name.rsplit(".", 1)[1])

    for op in ("PutObject", "UploadPart"):
        client.meta.events.register(f"before-send.s3.{op}", corrupt)
    return corrupted


@pytest.mark.parametrize("size", [1 * MiB, 11 * MiB])
def test_the_server_rejects_an_upload_corrupted_in_transit(any_s3_store_url: str,
                                                           size: int) -> None:
    """Every upload carries two digests of its body that the server checks before storing
    anything: botocore's CRC32 (x-amz-checksum-crc32), which SeaweedFS and AWS check, and,
    over plain http, the SigV4 payload hash (x-amz-content-sha256), which Ceph RGW checks
    (it ignores x-amz-checksum-* headers; SeaweedFS does not check the payload hash: see
    test_server_behaviour). Dropping either would leave one of the servers unprotected."""
    bucket, prefix = split(any_s3_store_url)
    store = S3BlobStore(bucket, prefix, settings=S3Settings(
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL_S3"), addressing="path",
        multipart_threshold=5 * MiB, part_size=5 * MiB, max_attempts=1))
    data = os.urandom(size)
    digest = Digest.of(data)
    corrupted = _corrupt_bodies_in_transit(store.client)
    with pytest.raises(Unavailable, match="failed to store blob"):
        store.put(digest, [data])
    assert corrupted == (["PutObject"] if size < 5 * MiB else ["UploadPart"] * len(corrupted))
    assert store.stat(digest) is None  # nothing stored, not even the damaged bytes
    clean = S3BlobStore(bucket, prefix)
    sent: list[dict[str, str]] = []
    clean.client.meta.events.register(
        "before-send.s3.PutObject", lambda request, **_: sent.append(dict(request.headers)))
    assert clean.put(digest, [data]) and clean.get(digest) == data
    if size < 5 * MiB:
        headers = {k.lower(): v.decode() if isinstance(v, bytes) else v
                   for k, v in sent[0].items()}
        assert headers["x-amz-content-sha256"] == hashlib.sha256(data).hexdigest()
        crc = zlib.crc32(data).to_bytes(4, "big")
        assert headers["x-amz-checksum-crc32"] == base64.b64encode(crc).decode()


def test_payload_signing_off_leaves_seaweedfs_its_crc32_check(
        s3_store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVGRAFT_S3_PAYLOAD_SIGNING=off skips the SHA-256 of every body over http; SeaweedFS
    still refuses a body damaged in transit, by botocore's CRC32 (Ceph RGW would not: it
    checks only the signed payload hash, hence the default)."""
    monkeypatch.setenv("KVGRAFT_S3_PAYLOAD_SIGNING", "off")
    settings = S3Settings.from_env()
    assert settings.payload_signing is False
    bucket, prefix = split(s3_store_url)
    store = S3BlobStore(bucket, prefix, settings=S3Settings(
        endpoint_url=os.environ.get("AWS_ENDPOINT_URL_S3"), addressing="path",
        max_attempts=1, payload_signing=False))
    data = os.urandom(MiB)
    digest = Digest.of(data)
    corrupted = _corrupt_bodies_in_transit(store.client)
    with pytest.raises(Unavailable, match="failed to store blob"):
        store.put(digest, [data])
    assert corrupted == ["PutObject"] and store.stat(digest) is None
    clean = S3BlobStore(bucket, prefix, settings=settings)
    sent: list[dict[str, str]] = []
    clean.client.meta.events.register(
        "before-send.s3.PutObject", lambda request, **_: sent.append(dict(request.headers)))
    assert clean.put(digest, [data]) and clean.get(digest) == data
    headers = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in sent[0].items()}
    assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
    assert headers["x-amz-checksum-crc32"] == base64.b64encode(
        zlib.crc32(data).to_bytes(4, "big")).decode()
    for name, want in (("auto", None), ("on", True)):
        monkeypatch.setenv("KVGRAFT_S3_PAYLOAD_SIGNING", name)
        assert S3Settings.from_env().payload_signing is want
    monkeypatch.setenv("KVGRAFT_S3_PAYLOAD_SIGNING", "maybe")
    with pytest.raises(UsageError, match="KVGRAFT_S3_PAYLOAD_SIGNING"):
        S3Settings.from_env()


def test_iter_lists_only_blobs_under_its_prefix(store: S3BlobStore) -> None:
    digest = Digest.of(b"mine")
    store.put(digest, [b"mine"])
    for key in (f"{store.prefix}/sha256/ab/not-a-digest", f"{store.prefix}/notes.txt",
                f"{store.prefix}/sha256/{digest.hex[:2]}/{digest.hex[2:]}/nested"):
        store.client.put_object(Bucket=store.bucket, Key=key, Body=b"x")
    other = S3BlobStore(store.bucket, f"{store.prefix}-other")
    other.put(Digest.of(b"theirs"), [b"theirs"])
    assert [info.digest for info in store.iter()] == [digest]
    assert [info.digest for info in other.iter()] == [Digest.of(b"theirs")]


def test_bad_credentials_are_unavailable(any_s3_store_url: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = open_store(any_s3_store_url)
    assert isinstance(store, S3BlobStore)
    digest = Digest.of(b"x")
    for attempt in (lambda: store.stat(digest), lambda: store.put(digest, [b"x"]),
                    lambda: store.get(digest)):
        with pytest.raises(Unavailable) as e:
            attempt()
        assert e.value.exit_code == 7
        assert store.endpoint in e.value.message and store.bucket in e.value.message
        assert "AWS_SECRET_ACCESS_KEY" in str(e.value)


def test_missing_bucket_is_unavailable(any_s3_store_url: str) -> None:
    name = f"kvgraft-missing-{uuid.uuid4().hex[:8]}"
    store = S3BlobStore(name, "p")
    with pytest.raises(Unavailable) as e:
        store.put(Digest.of(b"x"), [b"x"])
    assert e.value.exit_code == 7
    assert f"bucket {name!r}" in e.value.message and store.endpoint in e.value.message
    assert "does not exist" in e.value.message
    # Some servers create a bucket on the first put; the store must not have done that.
    buckets = [b["Name"] for b in store.client.list_buckets()["Buckets"]]
    assert name not in buckets


def test_unreachable_endpoint_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    (port,) = free_ports(1)  # nothing listens there
    monkeypatch.setenv("KVGRAFT_S3_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    store = open_store("s3://some-bucket/p")
    with pytest.raises(Unavailable) as e:
        store.exists(Digest.of(b"x"))
    assert f"127.0.0.1:{port}" in e.value.message and "some-bucket" in e.value.message
    assert "KVGRAFT_S3_ENDPOINT_URL" in str(e.value)


class FlakyS3(http.server.BaseHTTPRequestHandler):
    """Answers HEAD on the bucket; fails HEAD on an object `failures` times with 503
    SlowDown, then describes a 42-byte object."""

    failures = 0
    object_requests = 0
    lock = threading.Lock()

    def do_HEAD(self) -> None:
        if self.path.count("/") > 1:
            with self.lock:
                type(self).object_requests += 1
                fail = type(self).object_requests <= type(self).failures
            if fail:
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", "42")
            self.send_header("Last-Modified", formatdate(time.time(), usegmt=True))
            self.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FlakyS3]]:
    handler = type("Flaky", (FlakyS3,), {"object_requests": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("KVGRAFT_S3_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    yield handler
    server.shutdown()
    server.server_close()


def test_transient_errors_are_retried(flaky: type[FlakyS3]) -> None:
    flaky.failures = 2
    store = open_store("s3://flaky-bucket/p")
    info = store.stat(Digest.of(b"x"))
    assert info is not None and info.stored_size == 42
    assert flaky.object_requests == 3


def test_retries_give_up_after_the_configured_attempts(
        flaky: type[FlakyS3], monkeypatch: pytest.MonkeyPatch) -> None:
    flaky.failures = 100
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    store = open_store("s3://flaky-bucket/p")
    with pytest.raises(Unavailable) as e:
        store.stat(Digest.of(b"x"))
    assert flaky.object_requests == 2
    assert "flaky-bucket" in e.value.message


def test_settings_from_env() -> None:
    custom = S3Settings.from_env({"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:1"})
    assert custom.addressing == "path" and custom.endpoint_url is None  # boto3 reads it
    assert S3Settings.from_env({}).addressing == "auto"
    ours = S3Settings.from_env({"KVGRAFT_S3_ENDPOINT_URL": "http://127.0.0.1:2",
                                "KVGRAFT_S3_ADDRESSING": "virtual", "AWS_MAX_ATTEMPTS": "3",
                                "KVGRAFT_S3_PART_MIB": "6", "KVGRAFT_S3_MULTIPART_MIB": "5"})
    assert (ours.endpoint_url, ours.addressing, ours.max_attempts) == \
        ("http://127.0.0.1:2", "virtual", 3)
    assert (ours.part_size, ours.multipart_threshold) == (6 * MiB, 6 * MiB)
    config = ours.botocore_config()
    # Read through vars(): botocore-stubs declare Config's options as constructor arguments
    # only, not as the attributes botocore sets from them.
    options = vars(config)
    assert options["retries"] == {"mode": "standard", "total_max_attempts": 3}
    assert options["s3"] == {"addressing_style": "virtual"}
    for bad in ({"KVGRAFT_S3_ADDRESSING": "sideways"}, {"AWS_MAX_ATTEMPTS": "many"},
                {"AWS_RETRY_MODE": "eager"}, {"KVGRAFT_S3_PART_MIB": "1"}):
        with pytest.raises(UsageError):
            S3Settings.from_env(bad)


def test_endpoint_variable_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1111")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:2222")
    monkeypatch.delenv("KVGRAFT_S3_ENDPOINT_URL", raising=False)
    assert S3BlobStore("b-1").endpoint == "http://127.0.0.1:1111"
    monkeypatch.setenv("KVGRAFT_S3_ENDPOINT_URL", "http://127.0.0.1:3333")
    assert S3BlobStore("b-1").endpoint == "http://127.0.0.1:3333"


@pytest.mark.parametrize("url", ["s3://", "s3:///prefix", "s3://Bad_Bucket/p", "s3://b/p?x=1",
                                 "s3://a..b/p"])
def test_bad_urls(url: str) -> None:
    with pytest.raises(UsageError):
        S3BlobStore.from_url(url)


def test_url_keeps_bucket_and_prefix() -> None:
    assert S3BlobStore.from_url("s3://my-bucket/team/kv/").url == "s3://my-bucket/team/kv"
    assert S3BlobStore.from_url("s3://my-bucket").url == "s3://my-bucket"


def test_missing_blob_is_not_found(store: S3BlobStore) -> None:
    with pytest.raises(NotFound):
        store.open(Digest.of(b"absent"))


def test_install_hint_without_boto3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "kvgraft.blobstore.s3", raising=False)
    monkeypatch.setitem(sys.modules, "boto3", None)  # makes `import boto3` fail
    with pytest.raises(MissingExtra) as e:
        open_store("s3://bucket/prefix")
    assert "[s3]" in e.value.message and "pip install 'kvgraft[s3]'" in str(e.value)

"""`s3://bucket/prefix`: blobs as objects `<prefix>/sha256/ab/cdef…` in an S3-compatible bucket.

Puts are conditional creates (`If-None-Match: *`), so the first writer of a digest wins and
a racing writer gets 412 instead of overwriting; a multipart object only becomes visible
when CompleteMultipartUpload (conditional too) succeeds, so no reader sees a partial blob.
s3transfer's managed uploads do not pass `IfNoneMatch` through, hence the multipart upload
here. Settings come from the standard boto3 places (credentials, region, AWS_ENDPOINT_URL_S3,
AWS_ENDPOINT_URL) and a few KVGRAFT_S3_* variables, read when a store is opened.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any, BinaryIO, NoReturn, TypeVar, cast
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions

from kvgraft.blobstore.base import BlobInfo, blob_path, too_large
from kvgraft.blobstore.s3io import BodyReader, PartsReader, read_exactly, slices
from kvgraft.blobstore.s3settings import S3Settings
from kvgraft.digest import Buffer, Digest
from kvgraft.errors import NotFound, Unavailable, UsageError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

T = TypeVar("T")
_log = logging.getLogger("kvgraft.s3")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_HEX = re.compile(r"[0-9a-f]+")
_MISSING = ("404", "NoSuchKey", "NotFound")
_DENIED = ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
           "InvalidToken", "ExpiredToken", "AllAccessDisabled")
_RACE_LOST = ("412", "PreconditionFailed")
# AWS answers 409 when a conditional write overlaps another one in flight; asking again
# settles it (the retry gets 412 once the other write completed).
_RACE_PENDING = ("409", "ConditionalRequestConflict")
_NETWORK = (botocore.exceptions.EndpointConnectionError,
            botocore.exceptions.ConnectionClosedError,
            botocore.exceptions.ConnectTimeoutError,
            botocore.exceptions.ReadTimeoutError,
            botocore.exceptions.ProxyConnectionError)


class S3BlobStore:
    def __init__(self, bucket: str, prefix: str = "", *,
                 settings: S3Settings | None = None) -> None:
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise UsageError(f"not a valid S3 bucket name: {bucket!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.settings = settings or S3Settings.from_env()
        # One session per store: boto3's default session is not safe to share across threads
        # while clients are created; the client itself is thread-safe.
        session = boto3.session.Session()
        try:
            self.client: S3Client = session.client(
                "s3", endpoint_url=self.settings.endpoint_url,
                config=self.settings.botocore_config())
        except (botocore.exceptions.BotoCoreError, ValueError) as e:
            raise Unavailable(f"cannot set up an S3 client for {self.url}: {e}",
                              hint="check KVGRAFT_S3_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 "
                                   "and AWS_DEFAULT_REGION") from None
        self.endpoint = self.client.meta.endpoint_url
        self._session = session
        self._presigner: S3Client | None = None
        self.client.meta.events.register("needs-retry.s3", self._say_retry)
        self._checked = False
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> S3BlobStore:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise UsageError(f"not an s3://bucket/prefix URL: {url!r}")
        if parts.query or parts.fragment:
            raise UsageError(f"s3 URLs take no query or fragment: {url!r}")
        return cls(parts.netloc, parts.path)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _key(self, digest: Digest) -> str:
        path = blob_path(digest)
        return f"{self.prefix}/{path}" if self.prefix else path

    # --- errors ------------------------------------------------------------------------

    def _say_retry(self, attempts: int, caught_exception: Exception | None = None,
                   **_: Any) -> None:
        """Say so when a request to the endpoint failed and botocore will try again, so a
        stalled endpoint is not silence until the final error."""
        if isinstance(caught_exception, _NETWORK) and attempts < self.settings.max_attempts:
            _log.warning("kvgraft: S3 endpoint %s: %s; retrying (attempt %d of %d)",
                         self.endpoint, caught_exception, attempts + 1,
                         self.settings.max_attempts)

    def _fail(self, e: Exception, action: str) -> NoReturn:
        where = f"bucket {self.bucket!r} at {self.endpoint}"
        if isinstance(e, botocore.exceptions.ClientError):
            code = _code(e)
            if code == "NoSuchBucket":
                raise Unavailable(f"S3 {where} does not exist",
                                  hint="create the bucket or fix KVGRAFT_BLOB_URL") from None
            if code in _DENIED:
                raise Unavailable(
                    f"S3 {where} refused to {action} ({code})",
                    hint="check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) "
                         "and the bucket policy") from None
            message = e.response.get("Error", {}).get("Message", "")
            raise Unavailable(f"S3 {where} failed to {action}: {code} {message}".rstrip(),
                              hint="retry later; see KVGRAFT_DEBUG=1 for details") from None
        if isinstance(e, botocore.exceptions.NoCredentialsError
                      | botocore.exceptions.PartialCredentialsError):
            raise Unavailable(f"no S3 credentials for {where}",
                              hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                   "or AWS_PROFILE") from None
        if isinstance(e, _NETWORK):
            raise Unavailable(f"cannot reach S3 {where} to {action}: {e}",
                              hint="check the endpoint (KVGRAFT_S3_ENDPOINT_URL or "
                                   "AWS_ENDPOINT_URL_S3) and that the server is up") from None
        raise Unavailable(f"S3 {where} failed to {action}: {e}") from None

    def _call(self, action: str, fn: Callable[[], T]) -> T:
        self._check_bucket()
        try:
            return fn()
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            self._fail(e, action)

    def _check_bucket(self) -> None:
        """Once per store: a missing bucket is named as such instead of surfacing later as
        "blob not found" (head_object cannot tell the two apart, and some servers create
        buckets on the first put)."""
        if self._checked:
            return
        with self._lock:
            if self._checked:
                return
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError as e:
                if _code(e) in _MISSING:
                    self._fail(_no_such_bucket(e), "open the bucket")
                # A policy may allow object access without ListBucket: let the object
                # calls themselves say whether access is really denied.
                if _code(e) not in _DENIED:
                    self._fail(e, "open the bucket")
            except botocore.exceptions.BotoCoreError as e:
                self._fail(e, "open the bucket")
            self._checked = True

    # --- reads -------------------------------------------------------------------------

    def stat(self, digest: Digest) -> BlobInfo | None:
        self._check_bucket()
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(digest))
        except botocore.exceptions.ClientError as e:
            if _code(e) in _MISSING:
                return None
            self._fail(e, f"stat blob {digest}")
        except botocore.exceptions.BotoCoreError as e:
            self._fail(e, f"stat blob {digest}")
        return BlobInfo(digest, head["ContentLength"], head["LastModified"].timestamp())

    def exists(self, digest: Digest) -> bool:
        return self.stat(digest) is not None

    def _get_object(self, digest: Digest, **kw: Any) -> Any:
        self._check_bucket()
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(digest), **kw)
        except botocore.exceptions.ClientError as e:
            if _code(e) in _MISSING:
                raise NotFound(f"blob {digest} is not in {self.url}") from None
            self._fail(e, f"read blob {digest}")
        except botocore.exceptions.BotoCoreError as e:
            self._fail(e, f"read blob {digest}")

    def open(self, digest: Digest) -> BinaryIO:
        response = self._get_object(digest)
        raw = BodyReader(response["Body"], lambda e: self._fail(e, f"read blob {digest}"))
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=256 << 10))

    def get(self, digest: Digest, max_size: int | None = None) -> bytes:
        """The whole blob; a large one is fetched as parallel ranged GETs after the first part.

        The size is checked from the response headers, before any of the body is read: an
        object replaced by a huge one is refused, not downloaded."""
        response = self._get_object(digest)
        size: int = response["ContentLength"]
        if max_size is not None and size > max_size:
            response["Body"].close()
            raise too_large(digest, self.url, size, max_size)
        part = self.settings.part_size
        if size < self.settings.multipart_threshold:
            try:
                # One read of a known length: a single allocation, no chunk joining.
                data: bytes = response["Body"].read()
            except (botocore.exceptions.BotoCoreError, OSError) as e:
                self._fail(e, f"read blob {digest}")
            return data
        body = BodyReader(response["Body"], lambda e: self._fail(e, f"read blob {digest}"))
        out = bytearray(size)
        view = memoryview(out)
        etag = response.get("ETag") or None

        def fetch_range(start: int) -> None:
            end = min(start + part, size)
            kw: dict[str, Any] = {"Range": f"bytes={start}-{end - 1}"}
            if etag:
                kw["IfMatch"] = etag  # the parts must come from one object version
            r = self._get_object(digest, **kw)
            read_exactly(BodyReader(r["Body"], lambda e: self._fail(e, f"read {digest}")),
                          view[start:end], f"blob {digest} in {self.url}")

        starts = range(part, size, part)
        with ThreadPoolExecutor(min(self.settings.concurrency, len(starts)),
                                thread_name_prefix="kvgraft-s3-get") as pool:
            futures = [pool.submit(fetch_range, s) for s in starts]
            with body:
                read_exactly(body, view[:part], f"blob {digest} in {self.url}")
            for f in futures:
                f.result()
        # One copy, for the rare blob above the multipart threshold: the protocol hands out
        # immutable bytes.
        return bytes(out)

    def _signer(self) -> S3Client:
        """Presigned URLs get a client of their own: botocore would otherwise sign them
        with SigV2, which newer regions and servers refuse, and SigV4 signs the host, so
        clients that reach the bucket elsewhere need a URL made for that endpoint. Made on
        first use (a client costs tens of milliseconds), under the lock: a session must not
        make clients in two threads at once."""
        with self._lock:
            if self._presigner is None:
                self._presigner = self._session.client(
                    "s3", endpoint_url=self.settings.public_endpoint_url or self.endpoint,
                    config=self.settings.botocore_config().merge(
                        botocore.config.Config(signature_version="s3v4")))
            return self._presigner

    def presign(self, digest: Digest, expires: int) -> str:
        """A URL that lets whoever holds it GET the stored blob for `expires` seconds, for
        clients that fetch from the bucket instead of through a server. Made locally, so a
        missing object is the client's 404, not an error here."""
        if not 1 <= expires <= 7 * 24 * 3600:  # SigV4's limit
            raise UsageError(f"a presigned URL lives 1 s to 7 days, not {expires} s")
        try:
            url: str = self._signer().generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": self._key(digest)},
                ExpiresIn=expires)
        except botocore.exceptions.BotoCoreError as e:
            self._fail(e, f"presign blob {digest}")
        return url

    def iter(self) -> Iterator[BlobInfo]:
        base = f"{self.prefix}/sha256/" if self.prefix else "sha256/"
        self._check_bucket()
        pages = iter(self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base))
        while True:
            try:
                page = next(pages)
            except StopIteration:
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
                self._fail(e, "list blobs")
            for obj in page.get("Contents", []):
                fan, _, rest = obj["Key"][len(base):].partition("/")
                name = fan + rest
                # Anything else under the prefix (an operator's file, a stray key) is not ours.
                if len(fan) != 2 or "/" in rest or len(name) != 64 or not _HEX.fullmatch(name):
                    continue
                yield BlobInfo(Digest(name), obj["Size"], obj["LastModified"].timestamp())

    # --- writes ------------------------------------------------------------------------

    def put(self, digest: Digest, parts: Sequence[Buffer]) -> bool:
        size = sum(memoryview(p).nbytes for p in parts)
        upload = self._put_single if size < self.settings.multipart_threshold \
            else self._put_multipart
        for _ in range(3):
            try:
                self._call(f"store blob {digest}", lambda: upload(digest, parts, size))
                return True
            except _RaceLost:
                # Another writer stored this digest first. Its bytes may differ from ours
                # (another codec or level won) and are verified by every reader, so what
                # matters is that a whole object is there.
                if self.stat(digest) is not None:
                    return False
            except _RacePending:
                continue
        raise Unavailable(f"S3 bucket {self.bucket!r} at {self.endpoint} kept refusing to "
                          f"store blob {digest} (concurrent writes)", hint="retry the push")

    def replace(self, digest: Digest, parts: Sequence[Buffer]) -> None:
        """Overwrite a blob the caller found corrupt (or missing) with good bytes.

        Unconditional on purpose: the conditional create would keep the bad object. Every
        writer of a digest writes bytes that decode to it, so racing repairs all leave a
        good object, and a reader sees the old or the new object whole (ranged reads of a
        large one are pinned to one ETag)."""
        size = sum(memoryview(p).nbytes for p in parts)
        if size < self.settings.multipart_threshold:
            self._call(f"repair blob {digest}",
                       lambda: self._put_single(digest, parts, size, create=False))
        else:
            self._call(f"repair blob {digest}",
                       lambda: self._put_multipart(digest, parts, size, create=False))

    def _put_single(self, digest: Digest, parts: Sequence[Buffer], size: int, *,
                    create: bool = True) -> None:
        condition: dict[str, Any] = {"IfNoneMatch": "*"} if create else {}
        with _race_errors():
            self.client.put_object(Bucket=self.bucket, Key=self._key(digest),
                                   Body=cast(IO[bytes], PartsReader(parts)), ContentLength=size,
                                   **condition)

    def _put_multipart(self, digest: Digest, parts: Sequence[Buffer], size: int, *,
                       create: bool = True) -> None:
        condition: dict[str, Any] = {"IfNoneMatch": "*"} if create else {}
        key = self._key(digest)
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        step = self.settings.part_size
        # The last part absorbs a short remainder (every part but the last must be ≥ 5 MiB).
        bounds = [(s, min(s + step, size)) for s in range(0, size, step)]
        if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < step:
            bounds[-2:] = [(bounds[-2][0], size)]

        def one(number: int, start: int, end: int) -> CompletedPartTypeDef:
            r = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                        PartNumber=number,
                                        Body=cast(IO[bytes],
                                                  PartsReader(slices(parts, start, end))),
                                        ContentLength=end - start)
            return {"PartNumber": number, "ETag": r["ETag"]}

        try:
            with ThreadPoolExecutor(min(self.settings.concurrency, len(bounds)),
                                    thread_name_prefix="kvgraft-s3-put") as pool:
                futures = [pool.submit(one, i + 1, s, e) for i, (s, e) in enumerate(bounds)]
                done = [f.result() for f in futures]
            # Some servers (SeaweedFS 4.x) check If-None-Match on completion without
            # serialising concurrent completions, so a writer that finished first is
            # looked for here and again below; on AWS the condition alone suffices.
            if create and self._present(key):
                raise _RaceLost
            with _race_errors():
                etag = self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id,
                    MultipartUpload={"Parts": done}, **condition).get("ETag")
        except BaseException:
            # Uploaded parts are invisible but billed until aborted.
            # If even the abort fails, a lifecycle rule for incomplete uploads cleans up.
            with contextlib.suppress(botocore.exceptions.BotoCoreError,
                                     botocore.exceptions.ClientError):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                   UploadId=upload_id)
            raise
        # A later completion may have replaced ours with another writer's (whole) object:
        # then the stored blob is theirs. Ceph returns no ETag on completion: nothing to
        # compare.
        stored = self.client.head_object(Bucket=self.bucket, Key=key).get("ETag")
        if create and etag and stored and etag != stored:
            raise _RaceLost

    def _present(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
        except botocore.exceptions.ClientError as e:
            if _code(e) in _MISSING:
                return False
            raise
        return True

    def delete(self, digest: Digest) -> bool:
        # DeleteObject succeeds whether or not the key exists, so ask first.
        if self.stat(digest) is None:
            return False
        self._call(f"delete blob {digest}", lambda: self.client.delete_object(
            Bucket=self.bucket, Key=self._key(digest)))
        return True


class _RaceLost(Exception):
    """A conditional create found the key present."""


class _RacePending(Exception):
    """A conditional create overlapped another write of the same key."""


@contextlib.contextmanager
def _race_errors() -> Iterator[None]:
    """Turn a conditional create's refusal into the race outcome put() acts on."""
    try:
        yield
    except botocore.exceptions.ClientError as e:
        if _code(e) in _RACE_LOST:
            raise _RaceLost from None
        if _code(e) in _RACE_PENDING:
            raise _RacePending from None
        raise


def _code(e: botocore.exceptions.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _no_such_bucket(e: botocore.exceptions.ClientError) -> botocore.exceptions.ClientError:
    """head_bucket's 404 carries no body; give it the code a GET would have had."""
    return botocore.exceptions.ClientError({"Error": {"Code": "NoSuchBucket"}},
                                           e.operation_name)

"""How an S3 blob store talks to its server, read from KVGRAFT_S3_* and the standard boto3
places when a store is opened (`S3Settings.from_env` documents each variable)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast
from urllib.parse import urlsplit

import botocore.config

from kvgraft.errors import UsageError

MiB = 1 << 20
Addressing = Literal["path", "virtual", "auto"]
RetryMode = Literal["legacy", "standard", "adaptive"]
_ADDRESSING: tuple[Addressing, ...] = ("path", "virtual", "auto")
_RETRY_MODES: tuple[RetryMode, ...] = ("legacy", "standard", "adaptive")


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 1) -> int:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise UsageError(f"{name} must be at least {minimum}, got {value}")
    return value


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not 0 < value <= 3600:
        raise UsageError(f"{name} must be between 0 and 3600 seconds, got {raw!r}")
    return value


def _payload_signing(raw: str) -> bool | None:
    choices = {"auto": None, "on": True, "off": False}
    if raw not in choices:
        raise UsageError(f"KVGRAFT_S3_PAYLOAD_SIGNING must be auto, on or off, got {raw!r}")
    return choices[raw]


@dataclass(frozen=True, slots=True)
class S3Settings:
    """How the store talks to S3; `from_env` documents each variable."""

    endpoint_url: str | None = None  # None: boto3's own resolution (AWS_ENDPOINT_URL_S3, …)
    # Where clients reach the bucket, when that is not where this process does (a server
    # inside a cluster, clients outside it): presigned URLs are signed for this host.
    public_endpoint_url: str | None = None
    addressing: Addressing = "auto"
    # A stalled endpoint fails within a minute by default: 4 attempts of at most
    # connect 5 s + read 10 s each, plus standard-mode backoff (< 8 s in all). The read
    # timeout bounds each wait for the next bytes, not a whole transfer.
    max_attempts: int = 4  # including the first try
    retry_mode: RetryMode = "standard"
    multipart_threshold: int = 16 * MiB
    part_size: int = 8 * MiB
    concurrency: int = 8  # parts in flight for one large blob
    connect_timeout: float = 5.0
    read_timeout: float = 10.0
    # Readers hash every blob against its SHA-256 key, so validating the server's CRC on
    # each GET only repeats that check; uploads keep botocore's checksums (the server
    # verifies them, catching corruption in transit before it is stored for good).
    response_checksum_validation: Literal["when_supported", "when_required"] = "when_required"
    # SHA-256 of every upload body in its SigV4 signature. None: botocore's choice (signed
    # over http, not over https where TLS and the CRC32 checksum cover it). False saves a
    # SHA-256 of every byte sent over http, and is safe only with a server that checks
    # x-amz-checksum-crc32 (SeaweedFS, AWS, MinIO); Ceph RGW ignores that header and checks
    # only the signed payload hash (docs/deploy.md).
    payload_signing: bool | None = None

    def __post_init__(self) -> None:
        if self.addressing not in _ADDRESSING:
            raise UsageError(f"S3 addressing must be one of {', '.join(_ADDRESSING)}, "
                             f"got {self.addressing!r}")
        if self.response_checksum_validation not in ("when_supported", "when_required"):
            raise UsageError("AWS_RESPONSE_CHECKSUM_VALIDATION must be when_supported or "
                             f"when_required, got {self.response_checksum_validation!r}")
        if self.retry_mode not in _RETRY_MODES:
            raise UsageError(f"the S3 retry mode must be one of {', '.join(_RETRY_MODES)}, "
                             f"got {self.retry_mode!r}")
        if self.part_size < 5 * MiB:
            raise UsageError("S3 multipart parts must be at least 5 MiB")
        if self.multipart_threshold < self.part_size:
            raise UsageError("the S3 multipart threshold must be at least one part")
        public = urlsplit(self.public_endpoint_url or "http://x")
        if public.scheme not in ("http", "https") or not public.netloc or public.query:
            raise UsageError("KVGRAFT_S3_PUBLIC_ENDPOINT_URL must be an http(s)://host[:port] "
                             f"URL, got {self.public_endpoint_url!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Settings:
        """KVGRAFT_S3_ENDPOINT_URL (wins over AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, which
        boto3 reads itself), KVGRAFT_S3_ADDRESSING=path|virtual|auto (default path when an
        endpoint is configured: S3-compatible servers rarely have wildcard DNS),
        AWS_MAX_ATTEMPTS / AWS_RETRY_MODE (botocore's names), KVGRAFT_S3_CONNECT_TIMEOUT /
        KVGRAFT_S3_READ_TIMEOUT (seconds), KVGRAFT_S3_MULTIPART_MIB,
        KVGRAFT_S3_PART_MIB, KVGRAFT_S3_CONCURRENCY, AWS_RESPONSE_CHECKSUM_VALIDATION,
        KVGRAFT_S3_PUBLIC_ENDPOINT_URL (the endpoint presigned URLs name),
        KVGRAFT_S3_PAYLOAD_SIGNING=auto|on|off (SHA-256 of upload bodies in the signature;
        auto: botocore's choice)."""
        env = os.environ if env is None else env
        endpoint = env.get("KVGRAFT_S3_ENDPOINT_URL") or None
        custom = bool(endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"))
        part = _int(env, "KVGRAFT_S3_PART_MIB", 8, 5) * MiB
        return cls(
            endpoint_url=endpoint,
            public_endpoint_url=env.get("KVGRAFT_S3_PUBLIC_ENDPOINT_URL") or None,
            # Validated in __post_init__, which names the variable's allowed values.
            addressing=cast(Addressing, env.get("KVGRAFT_S3_ADDRESSING")
                            or ("path" if custom else "auto")),
            max_attempts=_int(env, "AWS_MAX_ATTEMPTS", 4),
            connect_timeout=_seconds(env, "KVGRAFT_S3_CONNECT_TIMEOUT", 5.0),
            read_timeout=_seconds(env, "KVGRAFT_S3_READ_TIMEOUT", 10.0),
            retry_mode=cast(RetryMode, env.get("AWS_RETRY_MODE") or "standard"),
            multipart_threshold=max(_int(env, "KVGRAFT_S3_MULTIPART_MIB", 16, 5) * MiB, part),
            part_size=part,
            concurrency=_int(env, "KVGRAFT_S3_CONCURRENCY", 8),
            response_checksum_validation=cast(
                Literal["when_supported", "when_required"],
                env.get("AWS_RESPONSE_CHECKSUM_VALIDATION") or "when_required"),
            payload_signing=_payload_signing(env.get("KVGRAFT_S3_PAYLOAD_SIGNING") or "auto"),
        )

    def botocore_config(self) -> botocore.config.Config:
        return botocore.config.Config(
            s3=({"addressing_style": self.addressing} if self.payload_signing is None else
                {"addressing_style": self.addressing,
                 "payload_signing_enabled": self.payload_signing}),
            retries={"mode": self.retry_mode, "total_max_attempts": self.max_attempts},
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            response_checksum_validation=self.response_checksum_validation,
            # Part uploads of one blob plus the callers' own worker threads share the pool.
            max_pool_connections=max(16, 2 * self.concurrency),
        )

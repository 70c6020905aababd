"""Decode one zstd frame to exactly the size the caller expects (both codecs use it).

The declared content size is checked before anything is allocated, and the output is capped
at that size, so a frame that lies about its size fails instead of allocating what it claims.
"""

from __future__ import annotations

import zstandard

from kvgraft.digest import Buffer
from kvgraft.errors import IntegrityError


def decode_frame(body: Buffer, size: int, *, what: str = "frame",
                 dctx: zstandard.ZstdDecompressor | None = None) -> bytes:
    """Exactly one frame holding exactly `size` bytes; IntegrityError names `what` otherwise."""
    dctx = dctx or zstandard.ZstdDecompressor()
    try:
        declared = zstandard.get_frame_parameters(body).content_size
    except zstandard.ZstdError as e:
        raise IntegrityError(f"corrupt zstd {what}: {e}") from None
    if declared != size:
        raise IntegrityError(f"zstd {what} declares {declared} bytes, expected {size}")
    try:
        if size == 0:
            # One-shot decompression of a frame that declares no content returns b"" without
            # reading it; a streaming decoder has to reach the end of the frame.
            obj = dctx.decompressobj()
            out: bytes = obj.decompress(body)
            if not obj.eof or obj.unused_data:
                raise IntegrityError(f"zstd {what} is truncated or has trailing data")
            return out
        out = dctx.decompress(body, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise IntegrityError(f"corrupt zstd {what}: {e}") from None
    if len(out) != size:
        raise IntegrityError(f"zstd {what} decoded to {len(out)} bytes, expected {size}")
    return out

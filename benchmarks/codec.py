"""Chunk codecs against plain zstd level 1, on the same bytes in the same run.

`run(report)` calls `report(row)` once per (dtype, codec, threads) with a dict:
    bench "codec", dtype, codec, threads, size_mib, chunks,
    ratio (decoded / encoded bytes), encode_MBps, decode_MBps (decoded bytes per second),
    encode_x, decode_x (throughput over the baseline: zstd level 1, one thread, one stream),
    entropy_bound (order-0 ratio bound of the byte planes; on the baseline row only).
Input: the real SmolLM2 BF16 sample (tests/data/smollm2-bf16.kv, 80 tokens) as one chunk
payload exactly as push cuts it (~1.8 MB), repeated to about `size_mib`; F16 and F32 hold the
same values converted. Times are the median of `repeats`, the configurations
interleaved so that machine noise hits them alike. Threads > 1 encode/decode independent
chunks in parallel, as push and pull do.

    python -m benchmarks.codec [--size-mib 48] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvgraft.codecs.bytegroup import entropy_bound
from kvgraft.codecs.codec import Codec, get_codec
from kvgraft.digest import Buffer
from kvgraft.formats.chunks import gather, plan_chunks
from kvgraft.formats.kvfile import RawTensor, read_layout, write_kvfile

SAMPLE = Path(__file__).resolve().parent.parent / "tests" / "data" / "smollm2-bf16.kv"
DTYPES = ("BF16", "F16", "F32")
# (label, codec name, threads); the first is the baseline.
CONFIGS = (("zstd", "zstd", 1), ("zstd", "zstd", 2),
           ("zstd-bytegroup", "zstd-bytegroup", 1), ("zstd-bytegroup", "zstd-bytegroup", 2))

Report = Callable[[dict[str, Any]], None]


def _convert(bf16: bytes, dtype: str) -> bytes:
    f32 = (np.frombuffer(bf16, np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "BF16":
        return bf16
    if dtype == "F16":
        return f32.astype(np.float16).tobytes()
    return f32.tobytes()


def chunk_payloads(dtype: str, size_mib: int, sample: Path = SAMPLE) -> list[bytes]:
    """The sample as one chunk payload (as push cuts it), repeated to ~size_mib of chunks.

    Whole chunks are repeated rather than tokens within a chunk: chunks are encoded
    independently, so the repetition is invisible to every codec and the ratio stays that
    of real data (tokens tiled inside a chunk would hand zstd long matches).
    """
    layout = read_layout(sample)
    raw = sample.read_bytes()
    layers = []
    for lr in layout.layers:
        pair = [RawTensor(dtype, t.shape, _convert(raw[t.begin : t.end], dtype))
                for t in (lr.key, lr.value)]
        layers.append((pair[0], pair[1], lr.start))
    with tempfile.TemporaryDirectory() as tmp:
        path = write_kvfile(Path(tmp) / "sample.kv", layers, list(range(layout.token_count)),
                            layout.identity)
        converted = read_layout(path)
        (plan,) = plan_chunks(converted, converted.token_count)
        fd = os.open(path, os.O_RDONLY)
        try:
            payload = bytes(gather(fd, plan, bytearray()))
        finally:
            os.close(fd)
    copies = max(2, round(size_mib * 2**20 / len(payload)))
    return [payload] * copies


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(codec: Codec, chunks: Sequence[bytes], encoded: Sequence[Buffer], threads: int,
             pool: ThreadPoolExecutor) -> tuple[float, float]:
    """(encode seconds, decode seconds) over all chunks.

    Each result is dropped at once, as push drops a body once stored and pull a chunk once
    written: keeping every result alive would measure fresh-page faults (~5 us a page on this
    machine kind, as much as the codec itself) instead of the codec. Decoding reads bodies
    encoded before the timing.
    """

    def encode(chunk: bytes) -> None:
        codec.encode(chunk)

    def decode(pair: tuple[Buffer, int]) -> None:
        codec.decode(memoryview(pair[0]), pair[1])

    pairs = [(e, len(c)) for e, c in zip(encoded, chunks, strict=True)]

    def enc() -> None:
        if threads > 1:
            list(pool.map(encode, chunks))
        else:
            for chunk in chunks:
                encode(chunk)

    def dec() -> None:
        if threads > 1:
            list(pool.map(decode, pairs))
        else:
            for pair in pairs:
                decode(pair)

    return _timed(enc), _timed(dec)


def bench_dtype(dtype: str, size_mib: int, repeats: int, report: Report) -> None:
    chunks = chunk_payloads(dtype, size_mib)
    total = sum(len(c) for c in chunks)
    codecs = {name: get_codec(name) for _, name, _ in CONFIGS}
    encoded = {name: [bytes(memoryview(codec.encode(c))) for c in chunks]
               for name, codec in codecs.items()}
    for name, codec in codecs.items():  # a benchmark of a codec that is wrong measures nothing
        for e, c in zip(encoded[name][:2], chunks, strict=False):
            assert bytes(codec.decode(memoryview(e), len(c))) == c
    stored = {i: sum(len(e) for e in encoded[name]) for i, (_, name, _) in enumerate(CONFIGS)}
    times: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(CONFIGS))}
    with ThreadPoolExecutor(2) as pool:
        for _ in range(repeats):
            for i, (_, name, threads) in enumerate(CONFIGS):
                times[i].append(_measure(codecs[name], chunks, encoded[name], threads, pool))
    enc = {i: statistics.median(t[0] for t in ts) for i, ts in times.items()}
    dec = {i: statistics.median(t[1] for t in ts) for i, ts in times.items()}
    mb = total / 1e6
    bound = statistics.mean(entropy_bound(c) for c in chunks[:2])
    for i, (label, _, threads) in enumerate(CONFIGS):
        row: dict[str, Any] = {
            "bench": "codec", "dtype": dtype, "codec": label, "threads": threads,
            "size_mib": round(total / 2**20, 1), "chunks": len(chunks),
            "ratio": round(total / stored[i], 4),
            "encode_MBps": round(mb / enc[i], 1), "decode_MBps": round(mb / dec[i], 1),
            "encode_x": round(enc[0] / enc[i], 2), "decode_x": round(dec[0] / dec[i], 2)}
        if i == 0:
            row["entropy_bound"] = round(bound, 4)
        report(row)


def run(report: Report, *, size_mib: int = 48, repeats: int = 5,
        dtypes: Sequence[str] = DTYPES) -> None:
    for dtype in dtypes:
        bench_dtype(dtype, size_mib, repeats, report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    args = parser.parse_args()
    run(lambda row: print(json.dumps(row), flush=True), size_mib=args.size_mib,
        repeats=args.repeats, dtypes=args.dtypes.split(","))


if __name__ == "__main__":
    main()

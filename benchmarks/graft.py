"""Graft vs prefill for SmolLM2-135M-Instruct (BF16), and prefix lookup on 100k artifacts.

`run(report)` calls `report(row)` once per measurement, each row a JSON-able dict:
  {"bench": "graft", "tokens": N, "threads": T, "graft_s": ..., "prefill_s": ...,
   "speedup": prefill_s / graft_s, ...}
      graft_s: resolve + manifest + blobs from the local pull cache (verified) + identity
      check + the transformers cache built on the model's device (median of 5, warm cache);
      prefill_s: recomputing the same prefix with the model, same process, same threads.
  {"bench": "match", "artifacts": 100000, "seconds": ...}: registry.match on a catalog
      where every artifact is of the same model (the worst case for the lookup).

    python -m benchmarks.graft [--tokens 512,2048,6144] [--threads 1,2] [--workdir .bench]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parent.parent / "data" / "lighthouse.txt"
SIZES = (512, 2048, 6144)
THREADS = (1, 2)


def _registry(root: Path) -> Any:
    from kvgraft.client import Registry
    from kvgraft.config import Config

    return Registry(Config.from_env({"KVGRAFT_HOME": str(root / "home"),
                                     "KVGRAFT_CACHE": str(root / "cache")}))


def document_tokens(tokenizer: Any, n: int) -> list[int]:
    """The first n tokens of the shipped document, repeated if it is shorter."""
    from kvgraft.integrations.transformers import tokenize

    base = tokenize(tokenizer, DOC.read_text(encoding="utf-8"))
    return (base * (n // len(base) + 1))[:n]


def graft_rows(workdir: Path, sizes: tuple[int, ...], threads: tuple[int, ...],
               report: Callable[[dict[str, Any]], None]) -> None:
    from kvgraft.integrations.transformers import capture, load_graft, load_model, set_threads
    from kvgraft.integrations.transformers.capture import prefill

    root = workdir / "graft"
    reg = _registry(root)
    model_cache = workdir / "model-cache"  # the converted SmolLM2 survives between runs
    lm = load_model("smollm2", cache_dir=model_cache)
    try:
        for n in sizes:
            ids = document_tokens(lm.tokenizer, n)
            ref = f"bench/smollm2-{n}:v1"
            set_threads(max(threads))
            kv = capture(lm, root / f"graft-{n}.kv", token_ids=ids)
            reg.push(kv.path, ref)
            load_graft(ref, lm, registry=reg).cache()  # fills the pull cache
            for t in threads:
                set_threads(t)
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    load_graft(ref, lm, registry=reg).cache()
                    times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                prefill(lm, ids)
                pre = time.perf_counter() - t0
                g = statistics.median(times)
                report({"bench": "graft", "model": "smollm2-135m-instruct-bf16", "tokens": n,
                        "threads": t, "kv_bytes": kv.path.stat().st_size - 0,
                        "graft_s": round(g, 4), "prefill_s": round(pre, 3),
                        "speedup": round(pre / g, 1)})
    finally:
        reg.close()


def match_row(workdir: Path, report: Callable[[dict[str, Any]], None],
              artifacts: int = 100_000, chunks: int = 4) -> None:
    """Fill a catalog with `artifacts` rows of one model (chunk keys of random prefixes),
    push one real artifact, and time the lookup of a prompt that extends it."""
    import shutil

    from sqlalchemy import insert, select

    from kvgraft.catalog.models import ArtifactChunkRow, ArtifactRow, BlobRow, ModelRow
    from kvgraft.services.match import match
    from kvgraft.transfer.push import PushOptions
    from tests.support.synthetic import synthetic_identity, write_synthetic

    root = workdir / "match"
    shutil.rmtree(root, ignore_errors=True)
    reg = _registry(root)
    ident = synthetic_identity("bench-match")
    ids = list(range(5000, 5000 + 600))
    kv = write_synthetic(root / "real.kv", num_layers=2, kv_heads=1, head_dim=4, token_ids=ids,
                         name="bench-match")
    real = reg.push(kv, "bench/match:v1", options=PushOptions(chunk_tokens=128))
    catalog = reg.catalog
    now = datetime.now(UTC)
    t0 = time.perf_counter()
    with catalog.engine.begin() as conn:
        model_id = conn.execute(select(ModelRow.id).where(
            ModelRow.identity == str(ident.key))).scalar_one()
        blob = "sha256:" + "0" * 64
        conn.execute(insert(BlobRow), [{"digest": blob, "size": 1, "stored_size": 1,
                                        "codec": "raw", "created_at": now}])
        step = 10_000
        for lo in range(0, artifacts, step):
            rows, chunk_rows = [], []
            for i in range(lo, min(lo + step, artifacts)):
                digest = "sha256:" + hashlib.sha256(f"artifact {i}".encode()).hexdigest()
                rows.append({"digest": digest, "model_id": model_id, "manifest": "{}",
                             "size": 0, "token_count": chunks * 128, "chunk_tokens": 128,
                             "file_digest": blob, "file_size": 0, "created_at": now})
                for c in range(chunks):
                    key = hashlib.sha256(f"{i}/{c}".encode()).hexdigest()
                    chunk_rows.append({"artifact_digest": digest, "idx": c, "start": c * 128,
                                       "end": (c + 1) * 128, "blob_digest": blob,
                                       "prefix_key": "sha256:" + key, "created_at": now})
            conn.execute(insert(ArtifactRow), rows)
            conn.execute(insert(ArtifactChunkRow), chunk_rows)
    fill = time.perf_counter() - t0
    query = [*ids[:520], 1, 2, 3]
    found = match(reg, ident, query)  # warm the pull cache with the candidate's tokens
    assert found is not None and found.digest == real.digest and found.length == 520
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        match(reg, ident, query)
        times.append(time.perf_counter() - t0)
    miss = []
    for _ in range(20):
        t0 = time.perf_counter()
        match(reg, ident, [7] * 600)
        miss.append(time.perf_counter() - t0)
    report({"bench": "match", "artifacts": artifacts + 1, "chunk_rows": artifacts * chunks,
            "fill_s": round(fill, 2), "hit_s": round(statistics.median(times), 5),
            "miss_s": round(statistics.median(miss), 5), "matched_tokens": found.length})
    reg.close()


def run(report: Callable[[dict[str, Any]], None], *, workdir: Path = Path(".bench"),
        sizes: tuple[int, ...] = SIZES, threads: tuple[int, ...] = THREADS) -> None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        report({"bench": "graft", "skipped": "needs the [hf] extra (torch, transformers)"})
    else:
        graft_rows(workdir, sizes, threads, report)
    match_row(workdir, report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=",".join(map(str, SIZES)))
    parser.add_argument("--threads", default=",".join(map(str, THREADS)))
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    run(lambda row: print(json.dumps(row), flush=True), workdir=args.workdir,
        sizes=tuple(int(x) for x in args.tokens.split(",")),
        threads=tuple(int(x) for x in args.threads.split(",")))


if __name__ == "__main__":
    main()

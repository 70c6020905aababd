"""Synthetic grafts for the catalog-at-scale benchmark, and a bulk loader that writes the
rows `Catalog.record_push` would write for them, by COPY.

The grafts are what a vLLM deployment publishes: a handful of system prompts per model
(1–4k tokens, a few of them far more popular than the rest), each followed by a user's
turn, and a third of the grafts a further turn of an earlier graft (so long prefixes are
shared at every depth). One model identity holds half the grafts, 31 others the rest.
Chunks are 256 tokens (the default), manifests are shaped like SmolLM2-135M's (30 layers,
3 KV heads of 64, BF16: ~9 KiB plus ~220 bytes a chunk), every chunk's blob is named by
its prefix key (the same tokens under the same model are the same KV bytes, so shared
prefixes share blobs, as pushes dedupe them), 90% of grafts are tagged the way the vLLM
connector tags them (`t-<token digest>`), and grafts were created a minute apart.

The rows equal what `record_push` writes because they are made from a real `Manifest` by
`push_rows`, which mirrors `record_push` column for column; the benchmark pushes its first
grafts through `record_push` itself and compares the rows (`check_rows`) before it loads
the rest. The events are chained exactly as `kvgraft.catalog.events` chains them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

import numpy as np
from sqlalchemy import text

from kvgraft.catalog import Catalog
from kvgraft.catalog.events import GENESIS, event_hash
from kvgraft.catalog.records import BlobRecord, EventRecord, PushRecord
from kvgraft.digest import Digest, canonical_json
from kvgraft.formats.manifest import BlobRef, ChunkRef, LayerRef, Manifest, file_tree
from kvgraft.formats.prefix import prefix_keys
from kvgraft.identity.model import ModelIdentity
from tests.support.synthetic import synthetic_identity

CHUNK = 256
MODELS = 32
PROMPTS = 8  # system prompts per model
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
CHUNK_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
VOCAB = 49_152
EPOCH = datetime(2025, 1, 1, tzinfo=UTC)
CONFIG = {"head_dim": HEAD_DIM, "model_type": "llama", "num_hidden_layers": LAYERS,
          "num_key_value_heads": KV_HEADS}


@dataclass(frozen=True, slots=True)
class Graft:
    """One synthetic graft: its model, system prompt, and turns (seed, tokens) after it."""

    index: int
    model: int
    prompt: int
    turns: tuple[tuple[int, int], ...]
    tagged: bool
    created_at: datetime

    @property
    def repository(self) -> str:
        return f"team{self.model % 16}/vllm-m{self.model}"


@cache
def identity(model: int) -> ModelIdentity:
    return synthetic_identity(f"scale-{model}")


@cache
def prompt_tokens(model: int, prompt: int) -> np.ndarray:
    rng = np.random.default_rng([model, prompt, 1])
    return rng.integers(0, VOCAB, int(rng.integers(1024, 4097)), dtype=np.int64)


def turn_tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, 2]).integers(0, VOCAB, n, dtype=np.int64)


def tokens(g: Graft) -> np.ndarray:
    return np.concatenate([prompt_tokens(g.model, g.prompt),
                           *(turn_tokens(s, n) for s, n in g.turns)])


def grafts(first: int = 0, seed: int = 7) -> Iterator[Graft]:
    """An endless, reproducible sequence of grafts, numbered from `first`, a minute apart."""
    rng = np.random.default_rng(seed)
    recent: list[Graft] = []
    i = first
    while True:
        if recent and rng.random() < 1 / 3:  # a further turn of a recent conversation
            base = recent[int(rng.integers(len(recent)))]
            model, prompt, turns = base.model, base.prompt, base.turns
        else:
            model = 0 if rng.random() < 0.5 else int(rng.integers(1, MODELS))
            prompt, turns = min(int(rng.zipf(1.6)) - 1, PROMPTS - 1), ()
        turns = (*turns, (i, int(rng.integers(16, 1500))))
        g = Graft(i, model, prompt, turns, bool(rng.random() < 0.9),
                  EPOCH + timedelta(minutes=i - first))
        recent = [*recent[-63:], g] if len(turns) < 4 else recent
        yield g
        i += 1


def chunk_count(g: Graft) -> int:
    n = len(prompt_tokens(g.model, g.prompt)) + sum(t for _, t in g.turns)
    return -(-n // CHUNK)


def manifest(g: Graft) -> Manifest:
    ident, ids = identity(g.model), tokens(g)
    raw = ids.astype("<i8").tobytes()
    keys = prefix_keys(ident, raw, CHUNK)
    n = len(ids)
    chunks = tuple(ChunkRef(c, c * CHUNK, min((c + 1) * CHUNK, n),
                            Digest(hashlib.sha256(b"kv" + k.raw).hexdigest()),
                            (min((c + 1) * CHUNK, n) - c * CHUNK) * CHUNK_BYTES_PER_TOKEN, k)
                   for c, k in enumerate(keys))
    layers = tuple(LayerRef(i, 0, n, "BF16", KV_HEADS, HEAD_DIM, HEAD_DIM)
                   for i in range(LAYERS))
    rand = np.random.default_rng([g.index, 3]).bytes(32)
    token_blob = BlobRef(Digest.of(raw), len(raw))
    header = BlobRef(Digest(rand.hex()), 4096 + 96 * LAYERS)
    size = header.size + token_blob.size + sum(c.size for c in chunks)
    tree = file_tree(size, CHUNK, header.digest, token_blob.digest, [c.digest for c in chunks])
    return Manifest(ident, f"scale model {g.model}", CONFIG, n, token_blob, CHUNK, chunks,
                    layers, {}, tree, size, header,
                    provenance={"producer": "benchmarks.catalog_fill"})


def push_record(g: Graft, m: Manifest, digest: Digest | None = None) -> PushRecord:
    """The PushRecord a push of `g` commits (the blobs' stored sizes are made up);
    `digest` spares computing the manifest's digest again."""
    blobs = tuple(BlobRecord(b.digest, b.size, b.size * 7 // 10, "bytegroup-zstd")
                  for b in m.blobs())
    tag = f"t-{m.tokens.digest.hex[:32]}" if g.tagged else None
    event = EventRecord("push", "bench", "bench-host", repository=g.repository, tag=tag,
                        digest=digest or m.digest, detail={"blobs_stored": len(blobs)})
    return PushRecord(m, blobs, g.repository, tag, {}, event)


Rows = dict[str, list[tuple[Any, ...]]]
# The columns `push_rows` fills, per table, in its tuples' order.
COLUMNS = {
    "blobs": ("digest", "size", "stored_size", "codec", "created_at"),
    "models": ("identity", "architecture", "tokenizer", "weights", "name", "config",
               "created_at"),
    "artifacts": ("digest", "model_id", "manifest", "size", "token_count", "chunk_tokens",
                  "file_digest", "file_size", "created_at"),
    "artifact_blobs": ("artifact_digest", "blob_digest"),
    "artifact_chunks": ("artifact_digest", "idx", "start", "end", "blob_digest",
                        "prefix_key", "created_at"),
    "repository_artifacts": ("repository", "artifact_digest", "created_at"),
    "tags": ("repository", "tag", "artifact_digest", "updated_at"),
}


def push_rows(push: PushRecord, model_id: int, now: datetime, rows: Rows,
              canonical: bytes | None = None) -> None:
    """Append to `rows` what `Catalog.record_push` inserts for `push` (a new artifact),
    column for column; blobs and models as inserted, before ON CONFLICT drops repeats.
    `canonical`, the manifest's canonical JSON, spares encoding it again."""
    m = push.manifest
    raw = canonical or m.canonical()
    digest = str(Digest.of(raw))
    rows["blobs"] += [(str(b.digest), b.size, b.stored_size, b.codec, now) for b in push.blobs]
    ident = m.model
    rows["models"].append((str(ident.key), str(ident.architecture), str(ident.tokenizer),
                           str(ident.weights) if ident.weights else None, m.model_name,
                           canonical_json(dict(m.model_config)).decode(), now))
    rows["artifacts"].append((digest, model_id, raw.decode(), m.size, m.token_count,
                              m.chunk_tokens, str(m.file_digest), m.file_size, now))
    rows["artifact_blobs"] += [(digest, str(b.digest)) for b in m.blobs()]
    rows["artifact_chunks"] += [(digest, c.index, c.start, c.end, str(c.digest), str(c.prefix),
                                 now) for c in m.chunks]
    rows["repository_artifacts"].append((push.repository, digest, now))
    if push.tag is not None:
        rows["tags"].append((push.repository, push.tag, digest, now))


class EventChain:
    """Event rows chained as `kvgraft.catalog.events.append_event` chains them."""

    def __init__(self, seq: int = 0, prev: str = GENESIS) -> None:
        self.seq, self.prev = seq, prev

    def row(self, e: EventRecord, at: datetime) -> tuple[Any, ...]:
        self.seq += 1
        fields = {"actor": e.actor, "host": e.host, "action": e.action,
                  "repository": e.repository, "tag": e.tag,
                  "digest": str(e.digest) if e.digest else None, "outcome": e.outcome,
                  "detail": canonical_json(dict(e.detail)).decode()}
        h = event_hash(self.seq, self.prev, at, fields)
        row = (at, *fields.values(), self.seq, self.prev, h)
        self.prev = h
        return row


EVENT_COLUMNS = ("at", "actor", "host", "action", "repository", "tag", "digest", "outcome",
                 "detail", "seq", "prev_hash", "hash")


def unique(rows: Sequence[tuple[Any, ...]], key: slice = slice(0, 1)) -> list[tuple[Any, ...]]:
    """First row of each key (ON CONFLICT DO NOTHING, in insertion order)."""
    seen: dict[Any, tuple[Any, ...]] = {}
    for r in rows:
        seen.setdefault(r[key], r)
    return list(seen.values())


class Loader:
    """Loads grafts into a PostgreSQL catalog: the first ones through `record_push`, whose
    rows `check_pushed` compares with `push_rows`'; the rest by COPY, in batches."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.models: dict[str, int] = {}
        self.blobs: set[str] = set()
        self.chain = EventChain()

    def push(self, gs: Sequence[Graft]) -> None:
        for g in gs:
            self.catalog.record_push(push_record(g, manifest(g)))
        self.check_pushed(gs)
        self.resync()

    def resync(self) -> None:
        """Learn what others committed since (models, blobs, the chain's head)."""
        with self.catalog.engine.connect() as conn:
            self.models = dict(conn.execute(text("SELECT identity, id FROM models")).all())
            self.blobs = set(conn.execute(text("SELECT digest FROM blobs")).scalars())
            seq, prev = conn.execute(text(
                "SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1")).one()
        self.chain = EventChain(seq, prev)

    def check_pushed(self, gs: Sequence[Graft]) -> None:
        """The rows record_push wrote for `gs` are the rows push_rows makes for them (the
        timestamps aside: record_push stamps its own)."""
        made: Rows = {t: [] for t in COLUMNS}
        for g in gs:
            push_rows(push_record(g, manifest(g)), 0, EPOCH, made)
        with self.catalog.engine.connect() as conn:
            for t, cols in COLUMNS.items():
                keep = [i for i, c in enumerate(cols) if c not in ("created_at", "updated_at",
                                                                    "model_id")]
                listed = ", ".join(f'"{cols[i]}"' for i in keep)
                have = {tuple(r) for r in conn.execute(text(f"SELECT {listed} FROM {t}"))}
                want = {tuple(r[i] for i in keep) for r in made[t]}
                if have != want:
                    raise RuntimeError(f"bulk rows of {t} differ from what record_push wrote")

    def copy(self, gs: Sequence[Graft], pool: Executor | None = None) -> None:
        """COPY the rows of `gs`, built in `pool`'s processes when given."""
        parts = [gs[i:i + 500] for i in range(0, len(gs), 500)]
        built = list(pool.map(build_rows, parts) if pool else map(build_rows, parts))
        rows: Rows = {t: [] for t in COLUMNS}
        events = []
        for part, part_events in built:
            for model in part["models"]:
                if model[0] not in self.models:
                    self._add_model(model)
            for t in COLUMNS:
                rows[t] += part[t]
            events += [self.chain.row(e, at) for e, at in part_events]
        # build_rows left the model's identity where its id goes.
        rows["artifacts"] = [(r[0], self.models[r[1]], *r[2:]) for r in rows["artifacts"]]
        rows["blobs"] = [b for b in unique(rows["blobs"]) if b[0] not in self.blobs]
        self.blobs.update(b[0] for b in rows["blobs"])
        del rows["models"]
        self._copy([*rows.items(), ("events", events)])

    def _copy(self, tables: Sequence[tuple[str, list[tuple[Any, ...]]]]) -> None:
        raw = self.catalog.engine.raw_connection()
        try:
            cur = raw.cursor()
            cur.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            superuser = cur.fetchone()
            if superuser and superuser[0]:
                # The foreign keys' checks, a lookup per row, hold nothing the rows do not
                # guarantee by construction (every artifact, blob and model precedes its
                # references); a superuser may skip them for the load.
                cur.execute("SET LOCAL session_replication_role = replica")
            for t, batch in tables:
                cols = ", ".join(f'"{c}"' for c in (EVENT_COLUMNS if t == "events"
                                                    else COLUMNS[t]))
                with cur.copy(f"COPY {t} ({cols}) FROM STDIN") as cp:
                    for r in batch:
                        cp.write_row(r)
            raw.commit()
        finally:
            raw.close()

    def _add_model(self, row: tuple[Any, ...]) -> None:
        cols = COLUMNS["models"]
        with self.catalog.engine.begin() as conn:
            self.models[row[0]] = conn.execute(text(
                f"INSERT INTO models ({', '.join(cols)}) VALUES "
                f"({', '.join(':' + c for c in cols)}) RETURNING id"),
                dict(zip(cols, row, strict=True))).scalar_one()


def build_rows(gs: Sequence[Graft]) -> tuple[Rows, list[tuple[EventRecord, datetime]]]:
    """The rows of `gs` (each artifact row with its model's identity in place of its id),
    and their events with their times (to be chained in order). Runs in a worker process."""
    rows: Rows = {t: [] for t in COLUMNS}
    events = []
    for g in gs:
        m = manifest(g)
        raw = m.canonical()
        push = push_record(g, m, Digest.of(raw))
        push_rows(push, 0, g.created_at, rows, raw)
        rows["artifacts"][-1] = (rows["artifacts"][-1][0], str(m.model.key),
                                 *rows["artifacts"][-1][2:])
        events.append((push.event, g.created_at))
    rows["models"] = unique(rows["models"])
    rows["artifact_blobs"] = unique(rows["artifact_blobs"], slice(0, 2))
    return rows, events

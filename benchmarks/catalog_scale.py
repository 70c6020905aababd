"""The SQL catalog at 10k, 100k and 1M chunk rows (PostgreSQL, a schema of its own, dropped
afterwards), filled with synthetic grafts (benchmarks.catalog_fill).

For each size, one row {"bench": "catalog scale", "chunk_rows", "artifacts",
"lookup_ms": {"1": L, "16": L}, "floor_ms": {"1": L, "16": L},
"open_loop_ms": {"100": L, "200": L}, "lookup_load",
"publish_grafts_per_s", "ls_s", "ls_tags", "ls_glob_s", "gc_dry_run_s",
"gc_planned_artifacts", "fill_s", "load"}, each L {"p50", "p99", "n", "per_s",
"client_cpu_ms", "server_cpu_ms"}:
  lookup: the prefix index of the library's lookup (CatalogPrefixIndex.candidates, what
          `kvgraft match` and the vLLM connector ask the catalog before they open the
          candidates from the store), from client processes (spawned, each with its own
          engine, connection and CatalogPrefixIndex, as engines on other machines would be):
          closed loop, 1 client then 16, each sending its lookups back to back ("per_s":
          the throughput); open loop, 16 clients each sending at Poisson arrivals, 100 and
          200 lookups a second from all of them together, for 10 s, each latency measured
          from the lookup's scheduled send, so waiting behind a slow one counts ("per_s":
          the rate achieved). client_cpu_ms and server_cpu_ms: the CPU a lookup took, on
          average, in the client process and in its PostgreSQL backend (read from /proc:
          null for a server on another machine). The queries are prompts that extend a
          graft by a new turn, share only a system prompt, stop inside a graft, or share
          nothing (another model's tokens);
  floor:  the same clients, closed loop, each sending `SELECT 1` instead of a lookup, over
          the lookup's own path (pool checkout, driver, connection without a transaction):
          the latency any catalog query would have on this machine, the floor under the
          lookup's;
  publish: 4 threads each with its own connection committing new grafts through
          Catalog.record_push (the catalog half of a push; the blobs are not uploaded);
  ls:     Registry.list() of every tag, and of one team's repositories (`team3/*`);
  gc:     Registry.gc_plan(untagged_older_than=7 days) against an empty store (a dry run:
          the catalog's inventory and the plan; listing a store of a million blobs is the
          store's cost, not the catalog's).
"load" is the 1-minute load average before the size was measured and after it,
"lookup_load" after its lookups. With --explain, the plans (EXPLAIN (ANALYZE, BUFFERS)) of
every query of one lookup, of ls and of the gc inventory go to
.bench/catalog-plans-<size>.txt. A PNG of lookup latency against size goes to
.bench/catalog_scale.png.

    python -m benchmarks.catalog_scale [--quick] [--explain] [--sizes 10000,100000]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import re
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from benchmarks.catalog_fill import (
    MODELS,
    Graft,
    Loader,
    chunk_count,
    grafts,
    identity,
    manifest,
    prompt_tokens,
    push_record,
    tokens,
    turn_tokens,
)
from kvgraft.catalog import Catalog
from kvgraft.catalog.engine import make_engine
from kvgraft.catalog.lookup import prefix_lookup
from kvgraft.identity.model import ModelIdentity
from kvgraft.services.match import MAX_CANDIDATES
from kvgraft.services.prefixindex import CatalogPrefixIndex

SIZES = (10_000, 100_000, 1_000_000)
QUICK = SIZES[:2]
BATCH = 4000  # grafts per COPY transaction
CLIENTS = 16
LOOKUPS_1, LOOKUPS_16 = 300, 60  # per client, back to back
RATES = (100, 200)  # lookups a second from all the clients together, in the open loop
OPEN_S = 10.0  # seconds of each open-loop run
START_S = 1.0  # from sending the clients their work to their common start
PUBLISHERS, PUBLISHED = 4, 50  # grafts per publisher
Query = tuple[ModelIdentity, list[int]]


def server_url() -> str:
    from tests.support.daemons import ensure_postgres

    url = os.environ.get("KVGRAFT_BENCH_POSTGRES_URL") or ensure_postgres()
    if url is None:
        raise RuntimeError("no PostgreSQL server (set KVGRAFT_BENCH_POSTGRES_URL)")
    return url


@contextlib.contextmanager
def bench_schema(server: str) -> Iterator[str]:
    """A fresh schema on `server`, as a catalog URL; dropped afterwards."""
    schema = f"bench_scale_{uuid.uuid4().hex[:10]}"
    admin = create_engine(server)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    sep = "&" if "?" in server else "?"
    try:
        yield f"{server}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def queries(loaded: Sequence[Graft], n: int, seed: int) -> list[Query]:
    """Prompts a deployment sends: 40% extend a graft by a new turn, 30% share only a
    system prompt, 20% stop inside a graft, 10% share nothing."""
    rng = np.random.default_rng(seed)
    out: list[Query] = []
    for i in range(n):
        g = loaded[int(rng.integers(len(loaded)))]
        ids = tokens(g)
        kind = i % 10
        if kind < 4:
            ids = np.concatenate([ids, turn_tokens(10**9 + i, int(rng.integers(16, 600)))])
        elif kind < 7:
            ids = np.concatenate([prompt_tokens(g.model, g.prompt),
                                  turn_tokens(2 * 10**9 + i, int(rng.integers(16, 1500)))])
        elif kind < 9:
            ids = ids[: int(rng.integers(1, len(ids) + 1))]
        else:
            ids = turn_tokens(3 * 10**9 + i, int(rng.integers(256, 4096)))
        out.append((identity(g.model), [int(t) for t in ids]))
    return out


def percentiles(times: Sequence[float]) -> dict[str, float]:
    ms = sorted(t * 1000 for t in times)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"p50": round(q[49], 2), "p99": round(q[98], 2), "n": len(ms)}


def in_threads(n: int, url: str, work: Callable[[Catalog, int], list[float]]) -> list[float]:
    """Run `work(catalog, i)` in n threads, each with its own catalog (its own connection),
    started together; their timings, joined."""
    catalogs = [Catalog(make_engine(url), url) for _ in range(n)]
    results: list[list[float]] = [[] for _ in range(n)]
    start = threading.Barrier(n)

    def run(i: int) -> None:
        start.wait()
        results[i] = work(catalogs[i], i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in catalogs:
        c.close()
    return list(itertools.chain.from_iterable(results))


# What one lookup client is asked to do: what it sends ("lookup", or "floor": a `SELECT 1`
# over the lookup's connection path instead), its queries (used in turn), the monotonic
# clock time to start at, and either a count of lookups back to back (closed loop) or the
# send times, in seconds after the start, of lookups at a fixed arrival rate (open loop).
Work = tuple[str, list[Query], float, int | list[float]]
# What it answers: each lookup's latency, when its last lookup ended, and the CPU seconds
# its lookups took in this process and in its PostgreSQL backend (None where the server's
# process cannot be read: not on this machine).
Done = tuple[list[float], float, float, float | None]


def backend_cpu(pid: int | None) -> float | None:
    """CPU seconds the PostgreSQL backend `pid` has used, from /proc: None unless a process
    of that id on this machine is PostgreSQL's (the server runs here)."""
    try:
        if Path(f"/proc/{pid}/comm").read_text().strip() != "postgres":
            return None
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lookup_client(conn: Connection, url: str) -> None:
    """One lookup client in a process of its own (the engines' lookups do not share one
    interpreter): its own engine, connection and CatalogPrefixIndex, kept across runs. For
    each Work it answers a Done; an open-loop lookup's latency runs from its scheduled send
    time, so time spent waiting behind the client's previous lookup counts."""
    catalog = Catalog(make_engine(url), url)
    index = CatalogPrefixIndex(catalog)

    def lookup(q: Query) -> None:
        list(index.candidates(*q, MAX_CANDIDATES))

    def floor(q: Query) -> None:
        # What any query costs through the same pool checkout, driver and connection path
        with prefix_lookup(catalog) as c:
            c.conn.execute(text("SELECT 1")).all()

    conn.send("ready")
    while True:
        work: Work | None = conn.recv()
        if work is None:
            break
        what, qs, start, plan = work
        ask = floor if what == "floor" else lookup
        ask(qs[-1])  # connect, warm the pool
        with catalog.engine.connect() as c:  # the pool's one connection, reused by each lookup
            pid = c.execute(text("SELECT pg_backend_pid()")).scalar_one()
        if make_url(url).host not in (None, "", "localhost", "127.0.0.1", "::1"):
            pid = None  # a server elsewhere: its process ids are not this machine's
        times: list[float] = []
        time.sleep(max(0.0, start - time.monotonic()))
        cpu, server = time.process_time(), backend_cpu(pid)
        if isinstance(plan, int):
            for j in range(plan):
                t0 = time.monotonic()
                ask(qs[j % len(qs)])
                times.append(time.monotonic() - t0)
        else:
            for j, at in enumerate(plan):
                due = start + at
                time.sleep(max(0.0, due - time.monotonic()))
                ask(qs[j % len(qs)])
                times.append(time.monotonic() - due)
        end, cpu = time.monotonic(), time.process_time() - cpu
        server_after = backend_cpu(pid)
        conn.send((times, end, cpu, None if server is None or server_after is None
                   else server_after - server))
    catalog.close()


class LookupClients:
    """`n` lookup client processes (spawned: no state inherited from this one), started
    once and reused for every measurement."""

    def __init__(self, url: str, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs: list[BaseProcess] = []
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=lookup_client, args=(theirs, url), daemon=True)
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)
        for p in self.pipes:
            if p.recv() != "ready":
                raise RuntimeError("a lookup client failed to start")

    def run(self, works: Sequence[Work]) -> dict[str, float | None]:
        """Each Work to one client, run together from `start`: the latencies' percentiles,
        lookups per second from the start to the last one's end, and the CPU milliseconds
        a lookup took on average in the client and in the server."""
        for pipe, work in zip(self.pipes, works, strict=False):
            pipe.send(work)
        done: list[Done] = [pipe.recv() for pipe in self.pipes[:len(works)]]
        times = list(itertools.chain.from_iterable(d[0] for d in done))
        wall = max(d[1] for d in done) - works[0][2]
        servers = [d[3] for d in done]
        server = None if None in servers else sum(s or 0.0 for s in servers)
        return {**percentiles(times), "per_s": round(len(times) / wall),
                "client_cpu_ms": round(1000 * sum(d[2] for d in done) / len(times), 2),
                "server_cpu_ms": None if server is None else
                round(1000 * server / len(times), 2)}

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()


def lookups(clients: LookupClients, qs: Sequence[Query], n: int, per_client: int,
            what: str = "lookup") -> dict[str, float | None]:
    """Closed loop: `n` clients each sending `per_client` lookups back to back."""
    start = time.monotonic() + START_S
    return clients.run([(what, list(qs[i::n]), start, per_client) for i in range(n)])


def open_loop(clients: LookupClients, qs: Sequence[Query], rate: float,
              seed: int) -> dict[str, float | None]:
    """Open loop: every client sends lookups at Poisson arrivals, `rate` a second from all
    of them together, for OPEN_S seconds; each latency from the lookup's scheduled send
    (queueing counted: no coordinated omission)."""
    n = len(clients.pipes)
    rng = np.random.default_rng(seed)
    plans = []
    for _ in range(n):
        at = np.cumsum(rng.exponential(n / rate, size=int(rate / n * OPEN_S * 2) + 16))
        plans.append([float(t) for t in at[at < OPEN_S]])
    start = time.monotonic() + START_S
    return {**clients.run([("lookup", list(qs[i::n]), start, plans[i]) for i in range(n)]),
            "rate": rate}


def publish(url: str, first: int) -> float:
    """Grafts per second committed by PUBLISHERS threads through record_push."""
    def work(catalog: Catalog, i: int) -> list[float]:
        made = itertools.islice(grafts(first + i * 10**6, seed=100 + i), PUBLISHED)
        pushes = [push_record(g, manifest(g)) for g in made]
        t0 = time.perf_counter()
        for p in pushes:
            catalog.record_push(p)
        return [time.perf_counter() - t0]

    spans = in_threads(PUBLISHERS, url, work)
    return round(PUBLISHERS * PUBLISHED / max(spans), 1)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return round(time.perf_counter() - t0, 3), out


@contextlib.contextmanager
def registry(url: str) -> Iterator[Any]:
    """A Registry over the catalog at `url` and an empty local store."""
    from kvgraft.client import Registry
    from kvgraft.config import Config

    with tempfile.TemporaryDirectory(prefix="kvgraft-scale-") as tmp:
        home = Path(tmp)
        (home / "blobs").mkdir()
        reg = Registry(Config(home, url, (home / "blobs").as_uri(), home / "cache"))
        try:
            yield reg
        finally:
            reg.close()


@contextlib.contextmanager
def captured() -> Iterator[list[tuple[str, Any]]]:
    """Every statement any engine sends while inside, with its parameters."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    got: list[tuple[str, Any]] = []

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
               executemany: bool) -> None:
        got.append((statement, parameters))

    event.listen(Engine, "before_cursor_execute", before)
    try:
        yield got
    finally:
        event.remove(Engine, "before_cursor_execute", before)


def explain(url: str, what: str, statements: Sequence[tuple[str, Any]]) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of each SELECT among `statements`, as text."""
    engine = make_engine(url)
    out = []
    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        for sql, params in statements:
            if not sql.lstrip().upper().startswith(("SELECT", "WITH")):
                continue
            cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
            plan = "\n".join(r[0] for r in cur.fetchall())
            out.append(shorten(f"-- {what}\n{sql}\n{plan}\n"))
        raw.rollback()
    finally:
        raw.close()
        engine.dispose()
    return "\n".join(out)


def shorten(plan: str) -> str:
    """Long lists of placeholders and digests cut to their first few."""
    plan = re.sub(r"(%\(\w+\)s::VARCHAR, ){3,}", "…, ", plan)
    plan = re.sub(r"sha256:([0-9a-f]{8})[0-9a-f]{56}", r"sha256:\1…", plan)
    return re.sub(r"((?:sha256:\w+…,){3})(?:sha256:\w+…,)+", r"\1…,", plan)


# The query prefix lookup made before migration 0006, for the key most artifacts share.
OLD_HOLDERS = (
    "SELECT a.digest, a.token_count FROM artifacts a"
    " JOIN artifact_chunks c ON c.artifact_digest = a.digest"
    " WHERE c.prefix_key = (SELECT prefix_key FROM artifact_chunks"
    "                       GROUP BY prefix_key ORDER BY count(*) DESC LIMIT 1)"
    " ORDER BY a.created_at DESC, a.digest LIMIT 32")


def plans(url: str, qs: Sequence[Query]) -> str:
    """The plans of one lookup per kind of query, of `ls` and of the gc inventory."""
    catalog = Catalog(make_engine(url), url)
    out = []
    try:
        for kind in (0, 4, 7, 9):  # extends a graft, shares a prompt, inside one, nothing
            with captured() as got:
                list(CatalogPrefixIndex(catalog).candidates(*qs[kind], MAX_CANDIDATES))
            out.append(explain(url, f"lookup (query kind {kind})", got))
        out.append(explain(url, "before 0006: the newest holders of the most shared key",
                           [(OLD_HOLDERS, {})]))
        with registry(url) as reg:
            with captured() as got:
                reg.list()
            out.append(explain(url, "ls", got))
            with captured() as got:
                catalog.gc_inventory()
            out.append(explain(url, "gc inventory", got))
    finally:
        catalog.close()
    return "\n".join(out)


def measure(url: str, clients: LookupClients, loaded: Sequence[Graft],
            first: int) -> dict[str, Any]:
    load = round(os.getloadavg()[0], 2)
    qs = queries(loaded, 400, seed=len(loaded))
    row: dict[str, Any] = {
        "lookup_ms": {"1": lookups(clients, qs, 1, LOOKUPS_1),
                      str(CLIENTS): lookups(clients, qs, CLIENTS, LOOKUPS_16)},
        "floor_ms": {"1": lookups(clients, qs, 1, LOOKUPS_1, "floor"),
                     str(CLIENTS): lookups(clients, qs, CLIENTS, LOOKUPS_16, "floor")},
        "open_loop_ms": {str(r): open_loop(clients, qs, r, seed=r) for r in RATES},
        "lookup_load": round(os.getloadavg()[0], 2),
        "publish_grafts_per_s": publish(url, first)}
    with registry(url) as reg:
        row["ls_s"], tags = timed(reg.list)
        row["ls_tags"] = len(tags)
        row["ls_glob_s"], _ = timed(lambda: reg.list("team3/*"))
        row["gc_dry_run_s"], plan = timed(lambda: reg.gc_plan(untagged_older_than=7 * 86400))
        row["gc_planned_artifacts"] = len(plan.artifacts)
    return {**row, "load": [load, round(os.getloadavg()[0], 2)]}


def counts(catalog: Catalog) -> tuple[int, int]:
    with catalog.engine.connect() as conn:
        chunks = conn.execute(text("SELECT count(*) FROM artifact_chunks")).scalar_one()
        arts = conn.execute(text("SELECT count(*) FROM artifacts")).scalar_one()
    return int(chunks), int(arts)


def fill_to(loader: Loader, source: Iterator[Graft], loaded: list[Graft], size: int,
            pool: Executor | None = None) -> None:
    rows = sum(chunk_count(g) for g in loaded)
    while rows < size:
        batch: list[Graft] = []
        while rows < size and len(batch) < BATCH:
            batch.append(next(source))
            rows += chunk_count(batch[-1])
        loader.copy(batch, pool)
        loaded += batch
    with loader.catalog.engine.begin() as conn:
        # What autovacuum would do soon after such a load: fresh statistics for the planner.
        conn.execute(text("ANALYZE"))


def run(report: Callable[[dict[str, Any]], None], workdir: Path = Path(".bench"), *,
        sizes: Sequence[int] = SIZES, explain_plans: bool = True) -> None:
    found: list[dict[str, Any]] = []
    try:
        server = server_url()
    except RuntimeError as e:
        report({"bench": "catalog scale", "skipped": str(e)})
        return
    with bench_schema(server) as url:
        catalog = Catalog(make_engine(url), url)
        catalog.upgrade()
        loader, source = Loader(catalog), grafts()
        pool = ProcessPoolExecutor(2)  # the rows are built beside the COPY
        clients = LookupClients(url, CLIENTS)
        loaded = [next(source) for _ in range(3)]
        loader.push(loaded)  # through record_push, and the bulk rows checked against them
        try:
            for k, size in enumerate(sizes):
                t0 = time.perf_counter()
                fill_to(loader, source, loaded, size, pool)
                fill_s = round(time.perf_counter() - t0, 1)
                chunks, arts = counts(catalog)  # what the lookups see (publish adds some)
                row = measure(url, clients, loaded, (k + 1) * 10**8)
                loader.resync()  # the publishers' grafts
                row = {"bench": "catalog scale", "chunk_rows": chunks, "artifacts": arts,
                       "models": MODELS, **row, "fill_s": fill_s}
                if explain_plans and size == max(sizes):
                    qs = queries(loaded, 10, seed=1)
                    (workdir / f"catalog-plans-{size}.txt").write_text(plans(url, qs))
                report(row)
                found.append(row)
        finally:
            clients.close()
            pool.shutdown()
            catalog.close()
    plot(found, workdir / "catalog_scale.png")


def plot(rows: Sequence[dict[str, Any]], out: Path) -> bool:
    """Lookup latency against catalog size; False when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        print("no matplotlib: `pip install kvgraft[bench]` for the plot")
        return False
    from benchmarks.report import plot_lookup

    plot_lookup(rows, out)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10k and 100k chunk rows only")
    parser.add_argument("--sizes", help="comma-separated chunk row counts")
    parser.add_argument("--explain", action="store_true",
                        help="write the query plans at the largest size")
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else \
        (QUICK if args.quick else SIZES)
    args.workdir.mkdir(exist_ok=True)
    rows: list[dict[str, Any]] = []

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    run(report, args.workdir, sizes=sizes, explain_plans=args.explain)


if __name__ == "__main__":
    main()

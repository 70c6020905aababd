"""Prefix lookup: chunk prefix keys narrow it with indexed queries, tokens finish it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from kvgraft.catalog import Catalog
from kvgraft.catalog.lookup import has_prefix_key
from kvgraft.client import Registry
from kvgraft.formats.prefix import prefix_keys
from kvgraft.services.match import match
from kvgraft.transfer.push import PushOptions
from tests.support.harness import RegistryFactory, sql_catalog
from tests.support.synthetic import synthetic_identity, write_synthetic

BASE = list(range(1000, 1600))


@pytest.fixture
def registry(make_registry: RegistryFactory, catalog_url: str) -> Iterator[Registry]:
    """On SQLite and on PostgreSQL, whose lookup asks fewer, different queries."""
    Catalog.open(catalog_url, auto_upgrade=True).close()
    reg = make_registry(catalog_url=catalog_url)
    yield reg
    reg.close()


def push(registry: Registry, tmp: Path, name: str, ids: list[int], model: str = "m",
         chunk: int = 64) -> str:
    kv = write_synthetic(tmp / f"{name}.kv", num_layers=2, kv_heads=1, head_dim=4,
                         token_ids=ids, name=model)
    return str(registry.push(kv, f"t/{name}:v1", options=PushOptions(chunk_tokens=chunk)).digest)


def test_longest_prefix(registry: Registry, tmp_path: Path) -> None:
    ident = synthetic_identity("m")
    a = push(registry, tmp_path, "a", BASE[:300])
    b = push(registry, tmp_path, "b", BASE[:200] + [1, 2, 3] * 40)
    push(registry, tmp_path, "other-model", BASE[:500], model="other")
    found = match(registry, ident, [*BASE[:250], 9, 9])
    assert found is not None and str(found.digest) == a and found.length == 250
    assert found.shared_chunks == 3  # 192 tokens by key, the rest by token comparison
    found = match(registry, ident, [*BASE[:200], 1, 2, 3, 1, 7])
    assert found is not None and str(found.digest) == b and found.length == 204
    found = match(registry, ident, BASE[:300])
    assert found is not None and str(found.digest) == a and found.length == 300
    assert match(registry, ident, [5, 6, 7] * 50) is None
    assert match(registry, synthetic_identity("nobody"), BASE[:300]) is None


def test_other_chunk_sizes_and_short_queries(registry: Registry, tmp_path: Path) -> None:
    ident = synthetic_identity("m")
    c = push(registry, tmp_path, "c", BASE[:100], chunk=32)
    short = push(registry, tmp_path, "short", BASE[:20])
    found = match(registry, ident, [*BASE[:90], 0])
    assert found is not None and str(found.digest) == c and found.length == 90
    found = match(registry, ident, BASE[:20])  # shorter than a chunk: an exact match only
    assert found is not None and str(found.digest) in (short, c) and found.length == 20


def test_prefix_lookup_uses_the_index(make_registry: RegistryFactory) -> None:
    """The queries are index seeks, so a catalog of any size answers in O(log) time
    (benchmarks/graft.py times it on 100k artifacts; benchmarks/catalog_scale.py shows
    PostgreSQL's plans at 1M chunk rows)."""
    registry = make_registry()  # SQLite
    catalog = sql_catalog(registry)
    try:
        assert not has_prefix_key(catalog,
                                  prefix_keys(synthetic_identity(), b"\0" * 8, 1)[0])
        with catalog.engine.connect() as conn:
            plan = conn.execute(text("EXPLAIN QUERY PLAN SELECT idx FROM artifact_chunks"
                                     " WHERE prefix_key = 'x' LIMIT 1")).fetchall()
    finally:
        registry.close()
    assert "ix_artifact_chunks_prefix_key" in " ".join(str(r) for r in plan)


def test_graft_shorter_than_a_chunk_is_found_for_a_prompt_extending_it(
        registry: Registry, tmp_path: Path) -> None:
    ident = synthetic_identity("m")
    short = push(registry, tmp_path, "short", BASE[:20])  # one partial chunk of 64
    found = match(registry, ident, [*BASE[:20], 7, 8, 9])
    assert found is not None and str(found.digest) == short and found.length == 20
    assert found.references == ("t/short:v1",)
    found = match(registry, ident, [*BASE[:19], 7])  # diverges inside it: 19 tokens
    assert found is None or found.length < 20
    assert match(registry, ident, [1, *BASE[:20]]) is None


def test_partial_last_chunk_is_found_for_a_prompt_extending_it(
        registry: Registry, tmp_path: Path) -> None:
    ident = synthetic_identity("m")
    # Many newer artifacts share the first two chunks: the token comparison over a bounded
    # candidate list would not reach the one whose partial last chunk the prompt extends.
    tail = push(registry, tmp_path, "tail", BASE[:150])  # chunks 64 + 64 + 22
    for i in range(5):
        push(registry, tmp_path, f"noise{i}", [*BASE[:128], 5000 + i] * 1)
    found = match(registry, ident, [*BASE[:150], 1, 2, 3], max_candidates=3)
    assert found is not None and str(found.digest) == tail and found.length == 150
    assert found.references == ("t/tail:v1",)
    registry.tag("t/tail:v1", "t/other:latest")
    found = match(registry, ident, [*BASE[:150], 4])
    assert found is not None and set(found.references) == {"t/tail:v1", "t/other:latest"}


def test_a_scope_narrows_the_lookup_itself(registry: Registry, tmp_path: Path) -> None:
    """More grafts of the prefix outside the scope than a lookup takes candidates (32),
    all newer than the one inside it: the lookup still finds the one inside."""
    from kvgraft.services.match import MAX_CANDIDATES
    from kvgraft.services.prefixindex import RepositoryScope

    ident = synthetic_identity("m")
    kv = write_synthetic(tmp_path / "mine.kv", num_layers=2, kv_heads=1, head_dim=4,
                         token_ids=BASE[:256], name="m")
    mine = registry.push(kv, "team/a:v1", options=PushOptions(chunk_tokens=64)).digest
    for i in range(MAX_CANDIDATES + 4):
        push(registry, tmp_path, f"n{i}", [*BASE[:256], i])  # t/n{i}: outside the scope
    unscoped = match(registry, ident, [*BASE[:256], 7, 7])
    assert unscoped is not None and unscoped.digest != mine
    found = match(registry, ident, [*BASE[:256], 7, 7],
                  repositories=RepositoryScope(("team/*",)))
    assert found is not None and found.digest == mine and found.length == 256
    assert match(registry, ident, BASE[:256], repositories=RepositoryScope(("x/*",))) is None
    # plain names need no listing of the catalog's repositories: the same answers
    assert RepositoryScope(("team/a", "x/y")).names == frozenset({"team/a", "x/y"})
    assert RepositoryScope(("team/a", "t/*")).names is None
    found = match(registry, ident, [*BASE[:256], 7], repositories=RepositoryScope(("team/a",)))
    assert found is not None and found.digest == mine
    assert match(registry, ident, BASE[:256], repositories=RepositoryScope(("x/y",))) is None


@pytest.mark.parametrize("chunk", [64, 256])
def test_postgres_lookup_answers_what_the_portable_queries_do(
        make_registry: RegistryFactory, postgres_url: str, tmp_path: Path, chunk: int) -> None:
    """PostgreSQL's lookup asks its own queries (the model's chunk sizes with how deep the
    chain of the usual size, 256, is held and that key's newest holders, the tail keys as
    one string); for the same grafts its candidates are those of the queries SQLite asks,
    whether the model's grafts are of the usual size or not, of one size or two, and
    whether or not more share a prefix than a lookup takes."""
    from kvgraft.services.prefixindex import CatalogPrefixIndex

    Catalog.open(postgres_url, auto_upgrade=True).close()
    lite = make_registry(home=tmp_path / "lite")
    pg = make_registry(home=tmp_path / "pg", catalog_url=postgres_url)
    u = chunk // 64  # the lengths below are in 64ths of a chunk
    base = list(range(1000, 1000 + 600 * u))

    def b(n: int) -> list[int]:
        return base[:n * u]

    grafts = {"a": b(300), "b": [*b(200), 1, 2, 3], "c": b(150), "d": b(20), "e": b(256),
              **{f"n{i}": [*b(128), i] for i in range(4)},
              **{f"t{n}": b(n) for n in range(130, 150, 5)}}  # ends inside chunk 3
    names = {}
    for reg in (lite, pg):
        for name, ids in grafts.items():
            names[push(reg, tmp_path, name, ids, chunk=chunk)] = name
        # The same model's grafts of another chunk size too.
        names[push(reg, tmp_path, "other", b(200), chunk=320 - chunk)] = "other"
    ident = synthetic_identity("m")

    def candidates(reg: Registry, ids: list[int], limit: int,
                   within: frozenset[str] | None = None) -> list[tuple[str, int, int]]:
        index = CatalogPrefixIndex(sql_catalog(reg), within=within)
        return sorted((names[str(c.digest)], c.covers, c.shared_chunks) for c in
                      index.candidates(ident, ids, limit))

    queries = [[*b(250), 9], b(300), [*b(200), 1, 2, 7], [*b(150), 1], [*b(20), 7], b(19),
               [5, 6, 7] * 50, b(64), b(128), b(256), [*b(130), 8],
               [*b(128), *range(5000, 5000 + 70 * u)], [*b(200), *[4] * 100 * u], [], [3]]
    try:
        # narrowed to repositories: the newest of a shared prefix outside, one graft of
        # the other size, nothing held
        scopes = (None, frozenset({"t/a", "t/c", "t/n1", "t/t135"}),
                  frozenset({"t/d", "t/other"}), frozenset({"t/none"}))
        for within in scopes:
            for limit in (32, 3):
                for ids in queries:
                    assert candidates(pg, ids, limit, within) == \
                        candidates(lite, ids, limit, within), (ids, limit, within)
        assert candidates(pg, b(300), 32, scopes[3]) == []
        inside = {n for n, _, _ in candidates(pg, [*b(128), 1], 32, scopes[1])}
        assert "n1" in inside and inside <= {"a", "c", "n1", "t135"}, inside
        # Every full chunk of the query held: its holders cover them, tokens do the rest.
        assert ("a", 256 * u, 4) in candidates(pg, b(300), 32)
    finally:
        lite.close()
        pg.close()

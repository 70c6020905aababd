"""`kvgraft audit`: one report that passes only when every record and byte checks out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvgraft.blobstore.memory import MemoryBlobStore
from kvgraft.catalog import Catalog
from kvgraft.cli.main import cli
from kvgraft.client import Registry
from kvgraft.transfer.push import PushOptions
from tests.support.harness import RegistryFactory, sql_catalog
from tests.support.synthetic import write_synthetic
from tests.support.tampering import tamper


@pytest.fixture
def family(make_registry: RegistryFactory, catalog_url: str,
           tmp_path: Path) -> tuple[Registry, list[str]]:
    """grandparent <- parent <- child, plus a sibling of the child; the child is signed."""
    Catalog.open(catalog_url, auto_upgrade=True).close()
    reg = make_registry(catalog_url=catalog_url, blob_url=f"memory://audit-{tmp_path.name}")
    digests: list[str] = []
    for i, name in enumerate(["grand", "parent", "child", "sibling"]):
        parents = () if i == 0 else (reg.resolve(f"fam/{'grand' if i == 1 else 'parent'}"),)
        src = write_synthetic(tmp_path / f"{name}.kv", tokens=300, seed=i)
        digests.append(str(reg.push(src, f"fam/{name}", options=PushOptions(parents=parents))
                           .digest))
    reg.keyring.generate("auditor")
    reg.sign("fam/child", "auditor")
    return reg, digests


def test_a_clean_artifact_audits_ok(family: tuple[Registry, list[str]]) -> None:
    reg, (grand, parent, child, sibling) = family
    report = reg.audit("fam/child")
    assert report.ok, report.failures
    doc = report.to_json()
    assert doc["digest"] == child and doc["tags"] == ["fam/child:latest"]
    assert doc["model"]["name"] == "synthetic"
    [p] = doc["lineage"]["parents"]
    assert p["digest"] == parent and p["parents"][0]["digest"] == grand
    assert doc["lineage"]["children"] == []
    assert reg.audit("fam/parent").to_json()["lineage"]["children"] == sorted([child, sibling])
    assert doc["attestations"][0]["signed"] and doc["attestations"][0]["ok"]
    assert doc["blobs"]["ok"] and doc["blobs"]["checked"] == 4
    assert [e["action"] for e in doc["events"]] == ["push", "sign"]
    assert doc["provenance"]["predicate"]["pushed"]["repository"] == "fam/child"
    assert doc["event_chain"]["ok"] and doc["event_chain"]["events"] == 5


def test_a_corrupt_blob_fails_the_audit(family: tuple[Registry, list[str]]) -> None:
    reg, _ = family
    manifest = reg.manifest(reg.resolve("fam/child"))
    store = reg.store
    assert isinstance(store, MemoryBlobStore)
    store.corrupt(manifest.chunks[0].digest, b"\x00" * 64)
    report = reg.audit("fam/child")
    assert not report.ok
    assert report.failures == (f"blob {manifest.chunks[0].digest}: "
                               + report.failures[0].split(": ", 1)[1],)


def test_a_deleted_event_fails_every_audit(family: tuple[Registry, list[str]]) -> None:
    reg, _ = family
    tamper(sql_catalog(reg), "DELETE FROM events WHERE seq = 2")  # the parent's push
    report = reg.audit("fam/child")
    assert not report.ok and report.failures == (
        "event log: event 2 missing from the event log (deleted?)",)


def test_a_missing_parent_is_reported(family: tuple[Registry, list[str]]) -> None:
    reg, (grand, *_) = family
    tamper(sql_catalog(reg), "DELETE FROM tags WHERE artifact_digest = :d", d=grand)
    tamper(sql_catalog(reg), "DELETE FROM artifacts WHERE digest = :d", d=grand)
    report = reg.audit("fam/child")
    assert report.failures == (f"lineage: parent: {grand} is not in the catalog",)


def test_audit_command(family: tuple[Registry, list[str]], cli_env: dict[str, str]) -> None:
    reg, (_, _, child, _) = family
    env = {**cli_env, "KVGRAFT_HOME": str(reg.config.home),
           "KVGRAFT_CATALOG_URL": reg.config.catalog_url, "KVGRAFT_BLOB_URL": reg.config.blob_url}
    runner = CliRunner(env=env)
    r = runner.invoke(cli, ["audit", "fam/child"])
    assert r.exit_code == 0, r.output
    assert "result: ok" in r.stdout and "signed by" in r.stdout
    r = runner.invoke(cli, ["audit", "fam/child", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["digest"] == child
    tamper(sql_catalog(reg), "UPDATE events SET actor = 'someone@else' WHERE seq = 3")
    r = runner.invoke(cli, ["audit", "fam/child", "--json"])
    assert r.exit_code == 4
    assert json.loads(r.stdout)["ok"] is False
    assert "event 3 was changed after it was written" in r.stderr
    assert runner.invoke(cli, ["audit", "fam/none"]).exit_code == 3

"""Ed25519 keys, the trust store, DSSE signatures and the signed-by policy, including
hostile cases: untrusted keys, signatures moved to another digest, edited records, and
interoperability with third-party DSSE verification."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from securesystemslib.dsse import Envelope
from securesystemslib.signer import SSlibKey

from kvgraft.catalog import AttestationRecord, Catalog
from kvgraft.cli.main import cli
from kvgraft.client import Registry
from kvgraft.digest import Digest
from kvgraft.errors import Conflict, IntegrityError, NotFound, UsageError
from kvgraft.provenance import PROVENANCE, PolicyRefused, PublicKey
from tests.support.harness import RegistryFactory, sql_catalog
from tests.support.synthetic import write_synthetic
from tests.support.tampering import tamper


@pytest.fixture
def two(make_registry: RegistryFactory, catalog_url: str,
        tmp_path: Path) -> tuple[Registry, Registry, Digest]:
    """Two users (separate homes: keyrings and trust stores) sharing one registry."""
    Catalog.open(catalog_url, auto_upgrade=True).close()
    store = (tmp_path / "store").as_uri()
    alice = make_registry(home=tmp_path / "alice", catalog_url=catalog_url, blob_url=store)
    bob = make_registry(home=tmp_path / "bob", catalog_url=catalog_url, blob_url=store)
    digest = alice.push(write_synthetic(tmp_path / "a.kv", tokens=300), "sig/a:v1").digest
    alice.keyring.generate("alice")
    bob.keyring.generate("bob")
    return alice, bob, digest


def test_keys_are_private_and_trusted_here(registry: Registry) -> None:
    public = registry.keyring.generate("team-key_1")
    keys = registry.config.home / "keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert stat.S_IMODE((keys / "team-key_1.key").stat().st_mode) == 0o600
    assert [(i.name, i.private, i.trusted) for i in registry.keyring.listing()] == [
        ("team-key_1", True, True)]
    assert registry.keyring.resolve("team-key_1") == public.keyid
    assert registry.keyring.resolve(public.keyid[:10]) == public.keyid
    with pytest.raises(Conflict):
        registry.keyring.generate("team-key_1")
    for bad in ("", "-x", "a/b", "x" * 65):
        with pytest.raises(UsageError):
            registry.keyring.generate(bad)
    with pytest.raises(NotFound):
        registry.keyring.signer("nobody")
    os.chmod(keys / "team-key_1.key", 0o644)
    with pytest.raises(UsageError, match="readable by others"):
        registry.keyring.signer("team-key_1")


def test_sign_then_policy_and_audit_accept(two: tuple[Registry, Registry, Digest]) -> None:
    alice, _, digest = two
    signed, keyid, att_id = alice.sign("sig/a:v1", "alice")
    assert signed == digest and keyid == alice.keyring.public("alice").keyid
    [att] = alice.catalog.attestations(digest)
    assert att.id == att_id and att.keyid == keyid and att.envelope is not None
    assert alice.pull("sig/a:v1", require_signed_by=["alice"]).digest == digest
    assert alice.pull("sig/a:v1", require_signed_by=[keyid[:12]]).digest == digest
    report = alice.audit("sig/a:v1")
    assert report.ok, report.failures
    assert report.attestations[0].signers == (keyid,)
    sign_events = alice.log("sig/a:v1", action="sign")
    assert sign_events[0].detail["keyid"] == keyid


def test_unsigned_and_untrusted_are_refused(two: tuple[Registry, Registry, Digest],
                                            tmp_path: Path) -> None:
    alice, bob, digest = two
    with pytest.raises(PolicyRefused, match="not signed"):
        alice.pull("sig/a:v1", require_signed_by=["alice"])
    bob.sign("sig/a:v1", "bob")
    bob_id = bob.keyring.public("bob").keyid
    # Alice has never trusted Bob's key: his signature counts for nothing here.
    with pytest.raises(PolicyRefused, match="trust store"):
        alice.pull("sig/a:v1", require_signed_by=[bob_id])
    with pytest.raises(PolicyRefused, match="not trusted"):
        alice.pull("sig/a:v1", require_signed_by=["alice"])
    report = alice.audit("sig/a:v1")
    assert not report.ok and "is not trusted" in report.failures[0]
    assert bob.audit("sig/a:v1").ok
    refused = alice.log("sig/a:v1", action="pull")
    assert [e.outcome for e in refused] == ["refused"] * 3
    exported = tmp_path / "bob.pub"
    exported.write_text(json.dumps(bob.keyring.public("bob").to_json()))
    assert alice.keyring.trust_file(exported)[1] is True
    assert alice.keyring.trust_file(exported)[1] is False
    assert alice.pull("sig/a:v1", require_signed_by=[bob_id]).digest == digest
    assert alice.audit("sig/a:v1").ok


def test_signature_moved_to_another_digest_is_refused(
        two: tuple[Registry, Registry, Digest], tmp_path: Path) -> None:
    alice, _, digest = two
    other = alice.push(write_synthetic(tmp_path / "b.kv", tokens=300, seed=9), "sig/b:v1")
    alice.sign("sig/a:v1", "alice")
    [good] = alice.catalog.attestations(digest)
    # The same valid envelope, recorded as if it were about the other artifact.
    alice.catalog.add_attestation(AttestationRecord(other.digest, PROVENANCE, good.statement,
                                                    good.envelope, good.keyid))
    with pytest.raises(PolicyRefused, match=f"about {digest}, not {other.digest}"):
        alice.pull("sig/b:v1", require_signed_by=["alice"])
    report = alice.audit("sig/b:v1")
    assert not report.ok and f"not {other.digest}" in report.failures[0]


@pytest.mark.parametrize("edit", ["statement", "statement-and-digest", "signature",
                                  "payload"])
def test_edited_attestation_is_detected(two: tuple[Registry, Registry, Digest],
                                        edit: str) -> None:
    alice, _, digest = two
    alice.sign("sig/a:v1", "alice")
    [att] = alice.catalog.attestations(digest)
    assert att.envelope is not None
    statement = json.loads(att.statement)
    statement["predicate"]["pushed"]["by"] = "mallory@elsewhere"
    forged = json.dumps(statement, sort_keys=True, separators=(",", ":"))
    envelope = json.loads(att.envelope)
    if edit == "statement":
        tamper(sql_catalog(alice), "UPDATE attestations SET statement = :s", s=forged)
    elif edit == "statement-and-digest":
        tamper(sql_catalog(alice), "UPDATE attestations SET statement = :s, statement_digest = :d",
               s=forged, d=str(Digest.of(forged.encode())))
    elif edit == "signature":
        sig = bytearray(base64.b64decode(envelope["signatures"][0]["sig"]))
        sig[0] ^= 1
        envelope["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
        tamper(sql_catalog(alice), "UPDATE attestations SET envelope = :e", e=json.dumps(envelope))
    else:  # a forged statement inside the envelope, with the stored statement to match
        envelope["payload"] = base64.b64encode(forged.encode()).decode()
        tamper(sql_catalog(alice), "UPDATE attestations SET envelope = :e, statement = :s, "
               "statement_digest = :d", e=json.dumps(envelope), s=forged,
               d=str(Digest.of(forged.encode())))
    with pytest.raises(PolicyRefused):
        alice.pull("sig/a:v1", require_signed_by=["alice"])
    report = alice.audit("sig/a:v1")
    assert not report.ok and report.failures[0].startswith("attestation")


def test_tampered_manifest_cannot_be_signed_and_fails_audit(
        two: tuple[Registry, Registry, Digest]) -> None:
    alice, _, digest = two
    alice.sign("sig/a:v1", "alice")
    raw = alice.catalog.artifact(digest).manifest.decode()
    tamper(sql_catalog(alice), "UPDATE artifacts SET manifest = :m",
           m=raw.replace('"chunkTokens":256', '"chunkTokens":255'))
    with pytest.raises(IntegrityError, match="corrupt"):
        alice.sign("sig/a:v1", "alice")
    report = alice.audit("sig/a:v1")
    assert not report.ok and report.failures[0].startswith("manifest:")


def test_exported_envelope_verifies_with_third_party_tools(cli_env: dict[str, str],
                                                           tmp_path: Path) -> None:
    runner = CliRunner(env=cli_env)
    src = write_synthetic(tmp_path / "a.kv", tokens=300)
    digest = runner.invoke(cli, ["push", str(src), "interop/a:v1"]).stdout.strip()
    assert runner.invoke(cli, ["key", "generate", "ci"]).exit_code == 0
    r = runner.invoke(cli, ["sign", "interop/a:v1", "--key", "ci"])
    assert r.exit_code == 0, r.output
    envelope_file, key_file, pem_file = (tmp_path / n for n in ("a.dsse", "ci.json", "ci.pem"))
    assert runner.invoke(cli, ["provenance", "export", "interop/a:v1", "--signed",
                               "-o", str(envelope_file)]).exit_code == 0
    assert runner.invoke(cli, ["key", "export", "ci", "-o", str(key_file)]).exit_code == 0
    assert runner.invoke(cli, ["key", "export", "ci", "--pem", "-o", str(pem_file)]
                         ).exit_code == 0
    document = json.loads(envelope_file.read_text())
    key_doc = json.loads(key_file.read_text())

    # securesystemslib, as any in-toto/DSSE tool built on it would use it.
    key = SSlibKey.from_dict(key_doc["keyid"], {k: key_doc[k]
                                                for k in ("keytype", "scheme", "keyval")})
    envelope = Envelope.from_dict(json.loads(envelope_file.read_text()))
    assert list(envelope.verify([key], 1)) == [key_doc["keyid"]]
    statement = json.loads(envelope.payload)
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["subject"][0]["digest"] == {"sha256": digest.removeprefix("sha256:")}

    # The DSSE spec by hand, with only `cryptography` and the PEM export.
    payload = base64.b64decode(document["payload"])
    ptype = document["payloadType"].encode()
    pae = b"DSSEv1 %d %b %d %b" % (len(ptype), ptype, len(payload), payload)
    pem_key = load_pem_public_key(pem_file.read_bytes())
    assert isinstance(pem_key, Ed25519PublicKey)
    pem_key.verify(base64.b64decode(document["signatures"][0]["sig"]), pae)  # raises if bad
    with pytest.raises(InvalidSignature):
        pem_key.verify(base64.b64decode(document["signatures"][0]["sig"]), pae + b" ")


def test_trust_add_checks_what_it_is_given(cli_env: dict[str, str], tmp_path: Path,
                                           registry: Registry) -> None:
    runner = CliRunner(env=cli_env)
    public = registry.keyring.generate("elsewhere")  # another home's key, exported as PEM
    pem = tmp_path / "k.pem"
    pem.write_bytes(public.pem())
    r = runner.invoke(cli, ["trust", "add", str(pem)])
    assert r.exit_code == 0 and r.stdout.strip() == public.keyid
    lying = tmp_path / "lying.json"
    lying.write_text(json.dumps({**public.to_json(), "keyid": "0" * 64}))
    r = runner.invoke(cli, ["trust", "add", str(lying)])
    assert r.exit_code == 4 and "keyid" in r.output
    rsa = tmp_path / "rsa.json"
    rsa.write_text(json.dumps({**public.to_json(), "keytype": "rsa"}))
    assert runner.invoke(cli, ["trust", "add", str(rsa)]).exit_code == 2
    garbage = tmp_path / "garbage.pub"
    garbage.write_bytes(b"\x00\x01not a key")
    assert runner.invoke(cli, ["trust", "add", str(garbage)]).exit_code == 2
    assert runner.invoke(cli, ["trust", "add", str(tmp_path / "missing.pub")]).exit_code == 3
    r = runner.invoke(cli, ["key", "ls", "--json"])
    assert [json.loads(line)["trusted"] for line in r.stdout.splitlines()] == [True]


def test_config_policy_applies_to_every_pull(cli_env: dict[str, str], tmp_path: Path) -> None:
    runner = CliRunner(env=cli_env)
    src = write_synthetic(tmp_path / "a.kv", tokens=300)
    assert runner.invoke(cli, ["push", str(src), "pol/a:v1"]).exit_code == 0
    assert runner.invoke(cli, ["key", "generate", "release"]).exit_code == 0
    config = Path(cli_env["KVGRAFT_HOME"]) / "config.toml"
    config.write_text('[policy]\nrequire_signed_by = ["release"]\n')
    r = runner.invoke(cli, ["pull", "pol/a:v1"])
    assert r.exit_code == 4 and "no valid signature" in r.output and "not signed" in r.output
    assert runner.invoke(cli, ["sign", "pol/a:v1", "--key", "release"]).exit_code == 0
    r = runner.invoke(cli, ["pull", "pol/a:v1", "--json"])
    assert r.exit_code == 0, r.output
    config.write_text('[policy]\nrequire_signed_by = ["nobody"]\n')
    assert runner.invoke(cli, ["pull", "pol/a:v1"]).exit_code == 3
    config.write_text('[policy]\nrequire_signed = true\n')
    r = runner.invoke(cli, ["pull", "pol/a:v1"])
    assert r.exit_code == 2 and "unknown keys" in r.output


def test_public_key_documents_are_checked() -> None:
    key = PublicKey.of(bytes(range(32)), "k")
    assert PublicKey.from_json(key.to_json()) == key
    assert PublicKey.parse(key.pem()).keyid == key.keyid
    with pytest.raises(IntegrityError):
        PublicKey("f" * 64, bytes(32))
    with pytest.raises(IntegrityError):
        PublicKey.of(bytes(31))
    with pytest.raises(UsageError):
        PublicKey.from_json({**key.to_json(), "keyval": {"public": "zz"}})

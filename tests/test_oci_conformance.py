"""The OCI distribution-spec conformance suite (upstream opencontainers/distribution-spec,
built offline from ../shared/reference/oci-conformance) against a real `kvgraft serve`,
authenticating with a scoped token as stock clients do. Every API and data group it has
is enabled except sha512 digests and sparse manifests (this registry speaks sha256 and
refuses manifests that name missing blobs). Its reports go outside the tree."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.serve import make_token, running_server, server_env

REPO_ROOT = Path(__file__).resolve().parents[1]
SUITE = Path(os.environ.get("KVGRAFT_OCI_CONFORMANCE",
                            REPO_ROOT.parent / "shared" / "reference" / "oci-conformance"))


def _build() -> Path:
    out = subprocess.run(["bash", str(SUITE / "build.sh")], check=True, capture_output=True,
                         text=True, timeout=900)
    return Path(out.stdout.strip().splitlines()[-1])


def _counts(report: str) -> dict[str, int]:
    tail = report[report.rfind("OCI Conformance Result"):]
    return {k: int(v) for k, v in re.findall(r"^\s+(\w+)\.+:\s+(\d+)$", tail, re.M)}


@pytest.mark.slow
@pytest.mark.parametrize("auth", ["basic", "bearer-token-flow"])
def test_conformance(tmp_path: Path, auth: str) -> None:
    if not (SUITE / "build.sh").is_file():
        pytest.skip(f"{SUITE} is absent")
    binary = _build()
    env = server_env(tmp_path / "home")
    secret = make_token(env, "conformance", "repository:conformance/*:pull,push,delete")
    results = Path(os.environ.get("KVGRAFT_OCI_RESULTS", tmp_path / "results")) / auth
    with running_server(env, tmp_path / "server.log") as server:
        suite_env = {
            **os.environ, "OCI_REGISTRY": f"127.0.0.1:{server.port}", "OCI_TLS": "disabled",
            "OCI_USERNAME": "conformance", "OCI_PASSWORD": secret,
            "OCI_RESULTS_DIR": str(results), "OCI_DATA_SHA512": "false",
            "OCI_API_BLOBS_UPLOAD_CANCEL": "true", "OCI_API_BLOBS_DIGEST_HEADER": "true",
            "OCI_API_MANIFESTS_DIGEST_HEADER": "true", "OCI_API_MANIFESTS_TAG_PARAM": "true",
            # Basic: credentials on every request; the token flow: one exchange, then the
            # bearer token it hands back.
            "OCI_CACHE_AUTH": "true" if auth == "basic" else "false",
        }
        run = subprocess.run([str(binary)], env=suite_env, capture_output=True, text=True,
                             timeout=900)
        assert server.alive(), server.log.read_text()[-3000:]
    report = run.stdout + run.stderr
    (tmp_path / "report.txt").write_text(report)
    counts = _counts(report)
    print(f"conformance ({auth}): {counts}")
    assert counts.get("Total", 0) > 700, report[-3000:]
    assert counts.get("FAIL", -1) == 0 and counts.get("Error", -1) == 0, report[-6000:]
    assert "Traceback" not in server.log.read_text()

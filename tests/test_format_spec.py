"""docs/format.md against the code: its verifier checks a real pull without kvgraft, and
the chunk, prefix key and blob frame rules, implemented here from the text alone, agree
with what push stores."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

from kvgraft.codecs.codec import frame, get_codec
from tests.support.synthetic import write_synthetic

DOCS = Path(__file__).resolve().parent.parent / "docs"
VERIFIER = DOCS / "verify_graft.py"
# Run the verifier where `import kvgraft` fails, whatever the environment has installed.
NO_KVGRAFT = ("import runpy, sys; sys.modules['kvgraft'] = None; sys.argv = sys.argv[1:]; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")


def kvgraft(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def verify(*args: Path | str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", NO_KVGRAFT, str(VERIFIER), *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=60, check=False)


@dataclass(frozen=True)
class Pulled:
    file: Path  # what `kvgraft pull -o` wrote
    inspect: Path  # what `kvgraft inspect --json` printed
    digest: str  # what `kvgraft push` printed
    home: Path

    def copies(self, where: Path) -> tuple[Path, Path]:
        """The file and the inspect output copied to `where`, for a test to damage."""
        file, inspect = where / "copy.kv", where / "inspect.json"
        shutil.copyfile(self.file, file)
        shutil.copyfile(self.inspect, inspect)
        return file, inspect

    def manifest(self) -> dict[str, Any]:
        manifest: dict[str, Any] = json.loads(self.inspect.read_text())["manifest"]
        return manifest


@pytest.fixture(scope="module")
def pulled(tmp_path_factory: pytest.TempPathFactory) -> Pulled:
    """One push and pull through the command line, shared by the tests that only read it."""
    tmp = tmp_path_factory.mktemp("spec")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGRAFT_")}
    env.update(KVGRAFT_HOME=str(tmp / "home"), KVGRAFT_CACHE=str(tmp / "cache"))
    src = write_synthetic(tmp / "src.kv", tokens=300, window=70, sliding=[1, 3])
    r = kvgraft(env, "push", str(src), "spec/doc:v1", "--chunk-tokens", "64")
    assert r.returncode == 0, r.stderr
    digest = r.stdout.strip().splitlines()[-1]
    out = tmp / "pulled.kv"
    assert kvgraft(env, "pull", "spec/doc:v1", "-o", str(out)).returncode == 0
    r = kvgraft(env, "inspect", "spec/doc:v1", "--json")
    assert r.returncode == 0, r.stderr
    inspect = tmp / "inspect.json"
    inspect.write_text(r.stdout)
    return Pulled(out, inspect, digest, tmp / "home")


def test_the_doc_embeds_the_verifier_verbatim() -> None:
    code = VERIFIER.read_text()
    assert f"```python\n{code}```\n" in (DOCS / "format.md").read_text()


def test_the_verifier_imports_only_hashlib_json_sys_and_safetensors() -> None:
    tree = ast.parse(VERIFIER.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported == {"hashlib", "json", "sys", "safetensors"}


def test_the_verifier_accepts_a_pulled_graft(pulled: Pulled, tmp_path: Path) -> None:
    r = verify(pulled.file, pulled.inspect)
    assert r.returncode == 0, r.stderr
    assert pulled.digest in r.stdout
    # The bare manifest (what a server sends at /v2/<name>/blobs/<digest>) with the digest.
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(pulled.manifest()))
    r = verify(pulled.file, manifest, pulled.digest)
    assert r.returncode == 0, r.stderr


def test_the_verifier_refuses_a_flipped_byte(pulled: Pulled, tmp_path: Path) -> None:
    file, inspect = pulled.copies(tmp_path)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(data)
    r = verify(file, inspect)
    assert r.returncode == 1
    assert "FAIL file:" in r.stderr and "FAIL chunk " in r.stderr


def test_the_verifier_checks_version_1_grafts_as_before(tmp_path: Path) -> None:
    # Grafts pushed before version 2 carry the file's and each tensor's SHA-256.
    from kvgraft.client import Registry
    from kvgraft.config import Config
    from kvgraft.transfer.push import PushOptions

    src = write_synthetic(tmp_path / "src.kv", tokens=300, window=70, sliding=[1, 3])
    reg = Registry(Config.from_env({"KVGRAFT_HOME": str(tmp_path / "home"),
                                    "KVGRAFT_CACHE": str(tmp_path / "cache")}))
    digest = reg.push(src, "spec/old:v1", options=PushOptions(chunk_tokens=64, version=1)).digest
    file = tmp_path / "old.kv"
    reg.pull("spec/old:v1", file)
    inspect = tmp_path / "old.json"
    inspect.write_text(json.dumps({"digest": str(digest),
                                   "manifest": reg.manifest(digest).to_json()}))
    assert reg.manifest(digest).to_json()["schemaVersion"] == 1
    r = verify(file, inspect)
    assert r.returncode == 0, r.stderr
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(data)
    r = verify(file, inspect)
    assert r.returncode == 1
    assert "FAIL file:" in r.stderr and "FAIL tensor layers." in r.stderr


def test_the_verifier_refuses_an_edited_manifest(pulled: Pulled, tmp_path: Path) -> None:
    file, inspect = pulled.copies(tmp_path)
    doc = json.loads(inspect.read_text())
    doc["manifest"]["provenance"]["seed"] = 1
    inspect.write_text(json.dumps(doc))
    r = verify(file, inspect)
    assert r.returncode == 1 and "manifest hashes to" in r.stderr
    # A manifest edited to describe another file does not hash to the pinned digest either.
    doc["manifest"]["provenance"]["seed"] = 0
    doc["manifest"]["file"]["size"] += 1
    inspect.write_text(json.dumps(doc))
    r = verify(file, inspect, pulled.digest)
    assert r.returncode == 1
    assert "manifest hashes to" in r.stderr and "file has" in r.stderr


def test_the_verifier_refuses_a_file_that_is_not_a_graft(pulled: Pulled, tmp_path: Path
                                                         ) -> None:
    junk = tmp_path / "junk.kv"
    junk.write_bytes(b"\xff" * 64)
    r = verify(junk, pulled.inspect)
    assert r.returncode == 1 and "FAIL" in r.stderr


# --- §5, §6: chunks and prefix keys, from the text ---------------------------------------


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    raw = path.read_bytes()
    n = struct.unpack_from("<Q", raw)[0]
    return n, json.loads(raw[8 : 8 + n])


def spec_chunks(path: Path, chunk_tokens: int) -> list[bytes]:
    """Chunk payloads of a KV file built as docs/format.md §5.1 says."""
    raw = path.read_bytes()
    n, header = _header(path)
    meta = header.pop("__metadata__")
    tokens = header["token_ids"]["shape"][0]
    layers = len([k for k in header if k.endswith(".key")])
    out = []
    for lo in range(0, tokens, chunk_tokens):
        hi = min(lo + chunk_tokens, tokens)
        entries, data = {}, b""
        for i in range(layers):
            start = int(meta.get(f"layers.{i}.start", "0"))
            a = max(lo, start)
            if a >= hi:
                continue
            for kind in ("key", "value"):
                spec = header[f"layers.{i}.{kind}"]
                heads, length, dim = spec["shape"]
                row = dim * 2  # BF16
                begin = 8 + n + spec["data_offsets"][0]
                runs = [raw[begin + (h * length + a - start) * row:][: (hi - a) * row]
                        for h in range(heads)]
                entries[f"layers.{i}.{kind}"] = {
                    "data_offsets": [len(data), len(data) + sum(map(len, runs))],
                    "dtype": spec["dtype"], "shape": [heads, hi - a, dim]}
                data += b"".join(runs)
        body = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)
        out.append(struct.pack("<Q", len(body)) + body + data)
    return out


def spec_prefix_keys(path: Path, manifest: dict[str, Any]) -> list[str]:
    raw = path.read_bytes()
    n, header = _header(path)
    begin, end = header["token_ids"]["data_offsets"]
    tokens = raw[8 + n + begin : 8 + n + end]
    m = manifest["model"]
    identity = {k: m[k] for k in ("architecture", "tokenizer", "weights")}
    model = hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":"))
                           .encode()).digest()
    chain, keys = bytes(32), []
    step = 8 * manifest["chunkTokens"]
    for lo in range(0, len(tokens), step):
        chain = hashlib.sha256(chain + model + tokens[lo : lo + step]).digest()
        keys.append("sha256:" + chain.hex())
    return keys


def test_chunks_and_prefix_keys_follow_the_text(pulled: Pulled) -> None:
    manifest = pulled.manifest()
    payloads = spec_chunks(pulled.file, manifest["chunkTokens"])
    assert [("sha256:" + hashlib.sha256(p).hexdigest(), len(p)) for p in payloads] == \
        [(c["digest"], c["size"]) for c in manifest["chunks"]]
    assert spec_prefix_keys(pulled.file, manifest) == [c["prefix"] for c in manifest["chunks"]]


# --- §7: stored blobs, decoded from the text ---------------------------------------------


def spec_zstd(body: bytes, size: int) -> bytes:
    assert zstandard.get_frame_parameters(body).content_size == size
    out: bytes = zstandard.ZstdDecompressor().decompress(body, max_output_size=size)
    return out


def spec_bytegroup(body: bytes, size: int) -> bytes:
    version, count = struct.unpack_from("<BI", body)
    assert version == 1
    at, segments = 5, []
    for _ in range(count):
        width, rotated, length = struct.unpack_from("<BBQ", body, at)
        at += 10
        planes = [struct.unpack_from("<BQ", body, at + 9 * j) for j in range(width)]
        at += 9 * width
        segments.append((width, rotated, length, planes))
    out = b""
    for width, rotated, length, planes in segments:
        m = length // width
        data = []
        for method, stored in planes:
            piece = body[at : at + stored]
            at += stored
            data.append(piece if method == 0 else spec_zstd(piece, m))
        # r = sum of plane_j[t] << 8j, rotated right by one bit if `rotated`.
        r = np.zeros(m, np.uint64)
        for j in range(width):
            r |= np.frombuffer(data[j], np.uint8).astype(np.uint64) << np.uint64(8 * j)
        if rotated:
            r = (r >> np.uint64(1)) | ((r & np.uint64(1)) << np.uint64(8 * width - 1))
        out += r.astype(f"<u{width}").tobytes()
    assert at == len(body) and len(out) == size
    return out


def spec_decode(stored: bytes) -> bytes:
    assert stored[:4] == b"KVGB" and stored[4] == 1
    k = stored[5]
    name = stored[6 : 6 + k].decode("ascii")
    size: int = struct.unpack_from("<Q", stored, 6 + k)[0]
    body = stored[14 + k :]
    if name == "raw":
        assert len(body) == size
        return body
    return {"zstd": spec_zstd, "zstd-bytegroup": spec_bytegroup}[name](body, size)


def test_stored_blobs_decode_by_the_text(pulled: Pulled) -> None:
    manifest = pulled.manifest()
    refs = [manifest["file"]["header"], manifest["tokens"]["blob"], *manifest["chunks"]]
    codecs = set()
    for ref in refs:
        h = ref["digest"].removeprefix("sha256:")
        stored = (pulled.home / "blobs" / "sha256" / h[:2] / h[2:]).read_bytes()  # §7.1
        codecs.add(stored[6 : 6 + stored[5]].decode())
        data = spec_decode(stored)
        assert len(data) == ref["size"] and hashlib.sha256(data).hexdigest() == h
    assert codecs == {"zstd", "zstd-bytegroup"}


@pytest.mark.parametrize("name", ["raw", "zstd", "zstd-bytegroup"])
def test_every_codec_decodes_by_the_text(name: str) -> None:
    rng = np.random.default_rng(7)
    floats = rng.standard_normal(3000).astype(np.float32)
    payloads = [b"", b"\x01" * 5, floats.tobytes(), floats.astype(np.float16).tobytes(),
                write_bf16_payload(floats)]
    for data in payloads:
        stored = b"".join(bytes(memoryview(p)) for p in frame(get_codec(name), data))
        assert spec_decode(stored) == data


def write_bf16_payload(values: np.ndarray) -> bytes:
    """A one-tensor safetensors payload, so bytegroup cuts it into rotated byte planes."""
    data = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    head = json.dumps({"t": {"data_offsets": [0, len(data)], "dtype": "BF16",
                             "shape": [len(values)]}}, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + data

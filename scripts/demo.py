"""`make demo`: push a KV file on the embedded default (SQLite + local blobs), then pull it
back in a separate process and show that the SHA-256 matches."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(".demo")


def kvgraft(env: dict[str, str], *args: str) -> str:
    print(f"$ kvgraft {' '.join(args)}", flush=True)
    proc = subprocess.run([sys.executable, "-m", "kvgraft.cli", *args],
                          env=env, text=True, capture_output=True, check=False)
    sys.stderr.write(proc.stderr)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(proc.returncode)
    return proc.stdout.strip()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def main() -> None:
    from tests.support.synthetic import write_synthetic

    shutil.rmtree(ROOT, ignore_errors=True)
    ROOT.mkdir()
    env = {**os.environ, "KVGRAFT_HOME": str((ROOT / "home").absolute()),
           "KVGRAFT_CACHE": str((ROOT / "cache").absolute())}
    src = write_synthetic(ROOT / "graft.kv", num_layers=30, kv_heads=3, head_dim=64,
                          tokens=2048, dtype="BF16", window=512, sliding=range(1, 30, 3),
                          name="demo-model")
    print(f"wrote a synthetic BF16 KV file: {src} ({src.stat().st_size / 2**20:.1f} MiB, "
          "2048 tokens, 30 layers, every third layer a 512-token sliding window)")
    digest = kvgraft(env, "push", str(src), "demo/graft:v1", "--label", "source=demo")
    kvgraft(env, "ls")
    kvgraft(env, "inspect", "demo/graft:v1")
    out = ROOT / "pulled.kv"
    pulled = kvgraft(env, "pull", "demo/graft:v1", "--output", str(out))
    kvgraft(env, "verify", "demo/graft:v1")
    a, b = sha256(src), sha256(out)
    print(f"pushed file  sha256:{a}\npulled file  sha256:{b}")
    if a != b or digest != pulled:
        raise SystemExit("MISMATCH: the pulled file differs from the pushed one")
    print("byte-identical: the pulled file has the same SHA-256 as the pushed one")


if __name__ == "__main__":
    main()

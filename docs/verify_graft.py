"""Check a pulled KV graft against its manifest without kvgraft (docs/format.md §11).

    python verify_graft.py FILE MANIFEST [sha256:<hex>]

FILE is what `kvgraft pull REF -o FILE` wrote. MANIFEST is a file holding the output of
`kvgraft inspect REF --json`, or the manifest JSON itself. The artifact digest to check
against is the third argument (pin the one you trust, e.g. from `name@sha256:...`), else
the `digest` that inspect printed. Exit status 0 if every check passes, 1 otherwise.
"""

import hashlib
import json
import sys

from safetensors import safe_open


def canonical(value):  # docs/format.md §1.3
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def sha256_of(f, begin, end):
    h = hashlib.sha256()
    f.seek(begin)
    while begin < end:
        block = f.read(min(1 << 20, end - begin))
        if not block:
            break  # shorter than the header says: the digest cannot match
        h.update(block)
        begin += len(block)
    return "sha256:" + h.hexdigest()


def verify(path, doc, expected=None):
    manifest = doc.get("manifest", doc)
    expected = expected or doc.get("digest")
    problems = []
    digest = "sha256:" + hashlib.sha256(canonical(manifest)).hexdigest()
    if expected is None:
        problems.append("no artifact digest to check the manifest against")
    elif digest != expected:
        problems.append(f"manifest hashes to {digest}, not to the artifact digest {expected}")
    want = {"file": manifest["file"]["digest"], "header": manifest["file"]["header"]["digest"],
            "token ids": manifest["tokens"]["blob"]["digest"]}
    want.update((f"tensor {k}", v) for k, v in manifest["tensors"].items())
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        got = {"file": sha256_of(f, 0, size), "header": sha256_of(f, 0, 8 + n)}
        for name, spec in header.items():
            begin, end = spec["data_offsets"]
            got[f"tensor {name}"] = sha256_of(f, 8 + n + begin, 8 + n + end)
        got["token ids"] = got.get("tensor token_ids")
    if size != manifest["file"]["size"]:
        problems.append(f"file has {size} bytes, the manifest says {manifest['file']['size']}")
    for what in sorted(set(want) | set(got)):
        if want.get(what) != got.get(what):
            problems.append(f"{what}: manifest has {want.get(what)}, file has {got.get(what)}")
    with safe_open(path, framework="numpy") as st:  # an independent parse of the same file
        meta = st.metadata() or {}
        for key in ("architecture", "tokenizer", "weights"):
            if (meta.get(f"model.{key}") or None) != manifest["model"][key]:
                problems.append(f"model.{key} of the file differs from the manifest's")
    return digest, problems


def main(argv):
    if len(argv) not in (3, 4):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        with open(argv[2], "rb") as f:
            doc = json.load(f)
        digest, problems = verify(argv[1], doc, argv[3] if len(argv) == 4 else None)
    except Exception as e:  # a file that does not even parse fails the check
        problems = [f"cannot check: {type(e).__name__}: {e}"]
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"ok {argv[1]} is artifact {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

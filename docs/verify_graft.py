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

SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E4M3FN": 1, "I16": 2,
         "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
         "F64": 8}


def canonical(value):  # docs/format.md §1.3
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def sha256_of(f, runs, prefix=b""):
    """SHA-256 of `prefix` then the file's bytes [begin, end) of each run, in order."""
    h = hashlib.sha256(prefix)
    for begin, end in runs:
        f.seek(begin)
        while begin < end:
            block = f.read(min(1 << 20, end - begin))
            if not block:
                break  # shorter than the header says: the digest cannot match
            h.update(block)
            begin += len(block)
    return h


def chunks(header, base, n, c):
    """(payload header, runs) of each chunk of the file (§5.1)."""
    meta = header.get("__metadata__", {})
    count = sum(1 for name in header if name.endswith(".key"))
    layers = [(header[f"layers.{i}.key"], header[f"layers.{i}.value"],
               int(meta.get(f"layers.{i}.start", "0"))) for i in range(count)]
    for lo in range(0, n, c):
        hi, entries, runs, pos = min(lo + c, n), {}, [], 0
        for i, (key, value, start) in enumerate(layers):
            a = max(lo, start)
            if a >= hi:
                continue  # a sliding-window layer that holds none of this span
            for kind, t in (("key", key), ("value", value)):
                heads, length, dim = t["shape"]
                row = dim * SIZES[t["dtype"]]
                size = heads * (hi - a) * row
                entries[f"layers.{i}.{kind}"] = {"data_offsets": [pos, pos + size],
                                                 "dtype": t["dtype"],
                                                 "shape": [heads, hi - a, dim]}
                pos += size
                for h in range(heads):
                    begin = base + t["data_offsets"][0] + (h * length + a - start) * row
                    runs.append((begin, begin + (hi - a) * row))
        text = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        yield len(text).to_bytes(8, "little") + text, runs


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
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        got = {"header": sha256_of(f, [(0, 8 + n)])}
        begin, end = header["token_ids"]["data_offsets"]
        got["token ids"] = sha256_of(f, [(8 + n + begin, 8 + n + end)])
        if manifest["schemaVersion"] == 1:  # the file's and each tensor's SHA-256 (§8.1)
            got["file"] = sha256_of(f, [(0, size)])
            want.update((f"tensor {k}", v) for k, v in manifest["tensors"].items())
            for name, spec in header.items():
                if name != "__metadata__":
                    begin, end = spec["data_offsets"]
                    got[f"tensor {name}"] = sha256_of(f, [(8 + n + begin, 8 + n + end)])
        else:  # each chunk's payload, and the tree over the blobs (§9.3)
            spans = [(0, 8 + n), (8 + n + begin, 8 + n + end)]
            c = manifest["chunkTokens"]
            tree = hashlib.sha256(b"kvgraft.file.v2\n" + size.to_bytes(8, "little")
                                  + c.to_bytes(8, "little") + got["header"].digest()
                                  + got["token ids"].digest())
            count = header["token_ids"]["shape"][0]
            for i, (head, runs) in enumerate(chunks(header, 8 + n, count, c)):
                got[f"chunk {i}"] = sha256_of(f, runs, head)
                tree.update(got[f"chunk {i}"].digest())
                spans += runs
            got["file"] = tree
            want.update((f"chunk {ch['index']}", ch["digest"]) for ch in manifest["chunks"])
            spans.sort()
            if [a for a, _ in spans] != [0] + [b for _, b in spans[:-1]] or \
                    spans[-1][1] != size:
                problems.append("the header, token ids and chunks do not cover the file "
                                "exactly once")
    got = {k: "sha256:" + h.hexdigest() for k, h in got.items()}
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

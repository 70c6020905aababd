"""The benchmark report: .bench/report.html and its PNG plots, built from .bench/results.json.

`make bench` builds it after the run; on an existing results.json:
    python -m benchmarks.report [--results .bench/results.json] [--out .bench]

One plot per kind of row the results hold (a kind with no rows is left out):
  TTFT against prompt length, one plot per engine ("vllm" rows and any other bench with
      "tokens" and "cold_s"): computed cold, restored by kvgraft, and the engine's own
      caches (its prefix cache, its example connector);
  throughput of kvgraft against the baseline measured beside it in the same run (rows
      with "kvgraft_MBps" and "baseline_MBps": push and pull, local, S3, server);
  prefix lookup latency against catalog size ("catalog scale" rows).
The HTML lists every row of the results under the plots. Plots need matplotlib (the
`bench` extra); without it the page still lists the rows and says why there are no plots.
"""

from __future__ import annotations

import argparse
import html
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]
# TTFT series of an engine row: field, label. Seconds; missing fields are skipped.
TTFT_SERIES = (
    ("cold_s", "computed (cold)"),
    ("restored_s", "restored by kvgraft (memory tier)"),
    ("restored_machine_cache_s", "restored by kvgraft (machine cache)"),
    ("restored_first_s", "restored by kvgraft (first, from the store)"),
    ("prefix_hit_s", "engine's own prefix cache"),
    ("example_s", "engine's example connector (disk)"),
)


def engine_rows(rows: Sequence[Row]) -> dict[str, list[Row]]:
    """Rows of TTFT against prompt length, by engine (the row's bench name)."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        if "tokens" in r and "cold_s" in r:
            out.setdefault(str(r["bench"]), []).append(r)
    return {k: sorted(v, key=lambda r: int(r["tokens"])) for k, v in out.items()}


def throughput_rows(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if "kvgraft_MBps" in r and "baseline_MBps" in r]


def catalog_rows(rows: Sequence[Row]) -> list[Row]:
    return sorted((r for r in rows if r.get("bench") == "catalog scale" and "lookup_ms" in r),
                  key=lambda r: int(r["chunk_rows"]))


def _figure(draw: Callable[[Any], None], out: Path, width: float = 6.5) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 4))
    draw(ax)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_ttft(engine: str, rows: Sequence[Row], out: Path) -> Path:
    def draw(ax: Any) -> None:
        tokens = [int(r["tokens"]) for r in rows]
        for field, label in TTFT_SERIES:
            points = [(t, float(r[field])) for t, r in zip(tokens, rows, strict=True)
                      if isinstance(r.get(field), int | float)]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=label)
        ax.set(xlabel="prompt tokens", ylabel="time to first token (s)",
               title=f"TTFT against prompt length: {engine}")

    return _figure(draw, out)


def plot_throughput(rows: Sequence[Row], out: Path) -> Path:
    def draw(ax: Any) -> None:
        names = [str(r["bench"]) for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["kvgraft_MBps"] for r in rows], 0.4, label="kvgraft")
        ax.bar([x + 0.2 for x in xs], [r["baseline_MBps"] for r in rows], 0.4,
               label="baseline (same run)")
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        ax.set(ylabel="MB/s", title="Push and pull throughput against their baselines")

    return _figure(draw, out, width=max(6.5, 0.8 * len(rows)))


def plot_lookup(rows: Sequence[Row], out: Path) -> Path:
    def draw(ax: Any) -> None:
        sizes = [int(r["chunk_rows"]) for r in rows]
        for clients, style in (("1", "-"), ("16", "--")):
            for q, marker in (("p50", "o"), ("p99", "s")):
                values = [r["lookup_ms"].get(clients, {}).get(q) for r in rows]
                if all(isinstance(v, int | float) for v in values):
                    plural = "s" if clients != "1" else ""
                    ax.plot(sizes, values, style, marker=marker,
                            label=f"{q}, {clients} client{plural} back to back")
        # 16 clients at a fixed arrival rate (the way engines look up), where measured.
        rates = sorted({k for r in rows for k in r.get("open_loop_ms", {})}, key=float)
        for rate, marker in zip(rates, "^v<>", strict=False):
            values = [r.get("open_loop_ms", {}).get(rate, {}).get("p99") for r in rows]
            if all(isinstance(v, int | float) for v in values):
                ax.plot(sizes, values, ":", marker=marker, label=f"p99, 16 clients, {rate}/s")
        # The same 16 clients back to back sending `SELECT 1`: the machine's floor.
        values = [r.get("floor_ms", {}).get("16", {}).get("p99") for r in rows]
        if all(isinstance(v, int | float) for v in values):
            ax.plot(sizes, values, "-.", color="grey", marker="x",
                    label="p99, 16 clients back to back, SELECT 1")
        ax.axhline(20, color="grey", linewidth=0.8, linestyle=":", label="20 ms target")
        ax.set(xscale="log", yscale="log", xlabel="chunk rows in the catalog",
               ylabel="prefix lookup (ms)",
               title="Prefix lookup against catalog size (PostgreSQL)")

    return _figure(draw, out)


def plots(rows: Sequence[Row], out_dir: Path) -> list[tuple[str, Path]]:
    """(caption, PNG) of every plot the rows allow."""
    made = []
    for engine, eng in engine_rows(rows).items():
        slug = "".join(ch if ch.isalnum() else "-" for ch in engine)
        made.append((f"TTFT against prompt length: {engine}",
                     plot_ttft(engine, eng, out_dir / f"report-ttft-{slug}.png")))
    if tp := throughput_rows(rows):
        made.append(("Push and pull throughput against their baselines",
                     plot_throughput(tp, out_dir / "report-throughput.png")))
    if cat := catalog_rows(rows):
        made.append(("Prefix lookup latency against catalog size",
                     plot_lookup(cat, out_dir / "report-catalog-lookup.png")))
    return made


def render(results: Row, figures: Sequence[tuple[str, Path]], note: str = "") -> str:
    esc = html.escape
    parts = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>kvgraft benchmarks</title>",
             "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
             "img{max-width:100%}pre{font-size:0.8em;white-space:pre-wrap}</style>",
             "</head><body>", "<h1>kvgraft benchmarks</h1>",
             f"<p>Run {esc(str(results.get('when', '?')))} on "
             f"{esc(json.dumps(results.get('machine', {})))}.</p>"]
    if note:
        parts.append(f"<p>{esc(note)}</p>")
    for caption, png in figures:
        parts += [f"<h2>{esc(caption)}</h2>",
                  f'<img src="{esc(png.name)}" alt="{esc(caption)}">']
    parts.append("<h2>Every row</h2>")
    parts += [f"<pre>{esc(json.dumps(r))}</pre>" for r in results.get("rows", [])]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def build(results_path: Path, out_dir: Path | None = None) -> Path:
    """Write report.html (and its PNGs) beside `results_path`, or into `out_dir`."""
    out_dir = out_dir or results_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    results = json.loads(results_path.read_text())
    rows = [r for r in results.get("rows", []) if isinstance(r, dict) and "bench" in r]
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        figures: list[tuple[str, Path]] = []
        note = "No plots: matplotlib is not installed (pip install 'kvgraft[bench]')."
    else:
        figures, note = plots(rows, out_dir), ""
    out = out_dir / "report.html"
    out.write_text(render(results, figures, note))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path(".bench/results.json"))
    parser.add_argument("--out", type=Path, help="folder for report.html (default: beside)")
    args = parser.parse_args()
    print(f"wrote {build(args.results, args.out)}")


if __name__ == "__main__":
    main()

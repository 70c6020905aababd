"""The benchmark report (benchmarks/report.py) from a small fabricated results.json: every
kind of plot is drawn, and every image the HTML shows exists."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks import report
from tests.support.harness import unavailable

ROWS: list[dict[str, Any]] = [
    {"bench": "vllm", "tokens": 512, "cold_s": 0.2, "prefix_hit_s": 0.02, "restored_s": 0.03,
     "restored_machine_cache_s": 0.04, "example_s": 0.05},
    {"bench": "vllm", "tokens": 2048, "cold_s": 0.9, "prefix_hit_s": 0.03, "restored_s": 0.05,
     "restored_machine_cache_s": 0.08, "example_s": None},
    {"bench": "local push", "size_mib": 64, "kvgraft_MBps": 900.0, "baseline_MBps": 700.0},
    {"bench": "s3 pull", "size_mib": 64, "kvgraft_MBps": 400.0, "baseline_MBps": 350.0},
    *({"bench": "catalog scale", "chunk_rows": n,
       "lookup_ms": {"1": {"p50": 2.0, "p99": 5.0}, "16": {"p50": 9.0, "p99": 18.0}},
       "open_loop_ms": {"100": {"p50": 3.0, "p99": 8.0}, "200": {"p50": 4.0, "p99": 12.0}},
       "floor_ms": {"1": {"p50": 0.3, "p99": 0.6}, "16": {"p50": 2.0, "p99": 10.0}}}
      for n in (10_000, 100_000)),
    {"bench": "codec", "skipped": "not here"},
]


def _results(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"when": "2026-12-04T00:00:00Z", "machine": {"cpus": 2},
                                "rows": rows}))
    return path


@pytest.fixture(autouse=True)
def _matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        unavailable("matplotlib (the test and bench extras install it)")


def test_report_shows_a_plot_of_each_kind_and_every_image_exists(tmp_path: Path) -> None:
    page = report.build(_results(tmp_path, ROWS))
    assert page == tmp_path / "report.html"
    text = page.read_text()
    images = re.findall(r'<img src="([^"]+)"', text)
    assert sorted(images) == ["report-catalog-lookup.png", "report-throughput.png",
                              "report-ttft-vllm.png"]
    for name in images:
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "not here" in text  # every row is listed


def test_report_without_rows_of_a_kind_leaves_its_plot_out(tmp_path: Path) -> None:
    out = tmp_path / "out"
    text = report.build(_results(tmp_path, ROWS[2:4]), out).read_text()
    assert re.findall(r'<img src="([^"]+)"', text) == ["report-throughput.png"]
    assert (out / "report-throughput.png").is_file()

"""``hyla simulate``'s tables fit 80 columns (a log, a small terminal) without cutting a
figure, and keep every figure on one line in a wide terminal."""

from __future__ import annotations

import io
import json
import pathlib

from rich.console import Console

from hyla.cli.simulate import capacity_table, results_table

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def render(table, width: int) -> list[str]:
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(table)
    return buf.getvalue().splitlines()


def test_capacity_table_fits_80_columns():
    res = json.loads((RESULTS / "disagg_published_calibrated_seeds.json").read_text())
    lines = render(capacity_table(res, "published setup, 5 seeds", wide=False), 80)
    assert max(map(len, lines)) <= 80 and not any("…" in line for line in lines)
    text = "\n".join(lines)
    for figure in ("homogeneous", "2.69", "+-3.9%", "t=20K", "7 prefill", "all remote",
                   "22.5 ms", "30%"):
        assert figure in text, figure
    wide = render(capacity_table(res, "published setup, 5 seeds"), 160)
    assert any("2.69 +- 0.1 (3.9%)" in line and "t=20,000, 7 prefill" in line for line in wide)


def test_fixed_rate_table_fits_80_columns():
    m = {"rate_req_s": 12.5, "throughput_tok_s": 123456.0, "goodput_req_s": 11.75,
         "ttft_p50_s": 0.7, "ttft_p90_s": 10.47, "tpot_p90_s": 0.0225, "egress_gbps": 30.1,
         "offload_fraction": 0.3, "threshold_final": 19400}
    res = {"deployments": {"homogeneous": {**m, "threshold_final": None}, "naive": m,
                           "prfaas": m}}
    lines = render(results_table(res, "published setup, fixed rate", wide=False), 80)
    assert max(map(len, lines)) <= 80 and not any("…" in line for line in lines)
    assert "123,456" in "\n".join(lines) and "19.4K" in "\n".join(lines)

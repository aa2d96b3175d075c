"""The published results carry no path of the machine that made them."""

from __future__ import annotations

import json
import pathlib
import re

from hyla.perf import write_results

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"
MACHINE_PATH = re.compile(r'"(/(?:tmp|home|root|work|Users|var|mnt|private)/[^"]*)"')


def test_no_results_file_holds_a_machine_path():
    found = {f.name: MACHINE_PATH.findall(f.read_text()) for f in RESULTS.glob("*.json")}
    assert not {k: v for k, v in found.items() if v}


def test_write_results_strips_machine_paths(tmp_path):
    path = write_results("demo", [{"trace": "/home/someone/traces/azure.csv"}],
                         results_dir=tmp_path, work=str(tmp_path / "run"),
                         url="/v1/completions")
    data = json.loads(path.read_text())
    assert data["rows"][0]["trace"] == "azure.csv" and data["work"] == "run"
    assert data["url"] == "/v1/completions"

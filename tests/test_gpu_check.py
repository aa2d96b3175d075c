"""benchmarks/gpu_check.sh --dry-run: the GPU check's own code, on the CPU at tiny shapes
(kernels that need CUDA recorded as skipped; CUDA graphs through a stand-in capture), so the
script that runs when a GPU is lent is known to work before it is."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = {"ops", "gla_speed", "streamkl_speed", "train", "serve", "decode"}


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu_check_dry.json"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=400, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin",
                                            "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["dry_run"] and record["device"] == "cpu"
    assert set(record["sections"]) == SECTIONS
    assert all(s["status"] == "ok" for s in record["sections"].values()), record["sections"]
    rows = record["rows"]
    assert {r["section"] for r in rows} == SECTIONS
    ops = [r for r in rows if r["section"] == "ops"]
    assert {r["op"] for r in ops} >= {"chunk_gla", "chunk_gated_delta(gdn)",
                                      "chunk_gated_delta(kda)", "recurrent_gla", "attention",
                                      "attention_kl", "newton_schulz"}
    assert all(r["ok"] for r in ops if "ok" in r)
    gla = [r for r in rows if r["section"] == "gla_speed"]
    assert all(str(r["fla_fwd_ms"]).startswith("skipped") for r in gla)   # fla needs CUDA
    serve = [r for r in rows if r["section"] == "serve"]
    graphed = next(r for r in serve if "cuda_graphs" in r["contender"])
    assert graphed["captures"] > 0 and graphed["capture_failures"] == 0
    assert "gpu_check sections" in proc.stdout

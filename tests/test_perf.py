import io
import json

import torch
from rich.console import Console

from hyla import perf


def test_machine_info_keys():
    info = perf.machine_info()
    for key in ("cpu", "cores", "torch", "python", "numpy", "torch_threads", "cuda_device"):
        assert key in info
    assert info["torch"] == torch.__version__
    json.dumps(info)


def test_time_fn_counts_calls_and_is_positive():
    calls = []
    t = perf.time_fn(lambda: calls.append(1), repeats=4, warmup=2)
    assert len(calls) == 6 and t >= 0


def test_matmul_peak_flops_tiny():
    assert perf.matmul_peak_flops(size=32, repeats=2) > 0
    assert perf.matmul_peak_flops(torch.bfloat16, size=16, repeats=1) > 0


def test_write_results(tmp_path):
    path = perf.write_results("demo", [{"n": 1, "t": 0.5}], results_dir=tmp_path, note="x")
    assert path == tmp_path / "demo.json"
    data = json.loads(path.read_text())
    assert data["rows"] == [{"n": 1, "t": 0.5}] and data["note"] == "x"
    assert data["machine"]["torch"] == torch.__version__


def test_print_table():
    buf = io.StringIO()
    perf.print_table("demo", [{"context": 1024, "us": 12.5}, {"context": 2048, "extra": 1e-7}],
                     console=Console(file=buf, width=120))
    out = buf.getvalue()
    assert "demo" in out and "1024" in out and "12.5" in out and "extra" in out

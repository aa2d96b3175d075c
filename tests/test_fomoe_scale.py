"""benchmarks/fomoe_scale.py: the system model's arithmetic (bytes, seconds, memory)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("fomoe_scale",
                                                  ROOT / "benchmarks" / "fomoe_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SHAPE = {"shared_fraction": 0.25, "experts": 8, "top_k": 2}


def point(scale, **kw):
    args = {"workers": 4, "replicas": 1, "sync_every": 16, "link_gbps": 8.0, "tokens": 1000,
            "flops": 6e12, "bytes_per_param": 2, "latency_s": 0.0}
    args.update(kw)
    return scale.model_point(1e9, SHAPE, **args)


def test_allreduce_bytes(scale):
    assert scale.allreduce_bytes(1e9, 4, 2) == pytest.approx(3e9)
    assert scale.allreduce_bytes(1e9, 1, 2) == 0


def test_bytes_per_strategy(scale):
    p = point(scale)
    ring = 2 * 3 / 4 * 1e9 * 2  # all-reduce of all parameters over 4 ranks, bf16
    assert p["fsdp"]["comm_bytes"] == pytest.approx(ring)
    assert p["diloco"]["comm_bytes"] == pytest.approx(ring / 16)
    # R = 1: only the shared quarter is synced
    assert p["fomoe"]["comm_bytes"] == pytest.approx(0.25 * ring / 16)
    # R = 2: plus each held expert (0.75e9 * 2 / 4 values) over its 2 holders
    p2 = point(scale, replicas=2)
    expert = 2 * 1 / 2 * 0.75e9 * 2 / 4 * 2
    assert p2["fomoe"]["comm_bytes"] == pytest.approx((0.25 * ring + expert) / 16)


def test_r_equals_w_is_diloco(scale):
    p = point(scale, replicas=4)
    assert p["fomoe"]["comm_bytes"] == pytest.approx(p["diloco"]["comm_bytes"])
    assert p["fomoe"]["compute_s"] == pytest.approx(p["diloco"]["compute_s"])
    assert p["fomoe"]["held_gb"] == pytest.approx(p["diloco"]["held_gb"])


def test_seconds_and_memory(scale):
    p = point(scale)
    active = 0.25e9 + 0.75e9 * 2 / 8
    assert p["active_params"] == pytest.approx(active)
    assert p["fsdp"]["compute_s"] == pytest.approx(6 * active * 1000 / 6e12)
    # token skipping at R/W = 1/4: routed compute a quarter
    assert p["fomoe"]["compute_s"] == pytest.approx(6 * (0.25e9 + 0.1875e9 / 4) * 1000 / 6e12)
    assert p["fsdp"]["comm_s"] == pytest.approx(p["fsdp"]["comm_bytes"] / 1e9)  # 8 Gbps = 1 GB/s
    assert p["fsdp"]["step_s"] == pytest.approx(p["fsdp"]["compute_s"] + p["fsdp"]["comm_s"])
    assert p["fsdp"]["held_gb"] == pytest.approx(16 * 1e9 / 4 / 1e9)
    assert p["fomoe"]["held_gb"] == pytest.approx(16 * (0.25e9 + 0.75e9 / 4) / 1e9)
    assert point(scale, latency_s=0.01)["fsdp"]["comm_s"] == pytest.approx(
        p["fsdp"]["comm_s"] + 2 * 3 * 0.01)


def test_bad_replicas(scale):
    with pytest.raises(ValueError, match="replicas"):
        point(scale, replicas=5)

"""Distributed Muon over gloo: both strategies equal single-device Muon; bytes are as planned."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyla.train.optim.comm import (
    assign_owners,
    planned_traffic,
    row_range,
    rows_per_rank,
    shard_rows,
)
from hyla.train.optim.dist_muon import DistMuon
from hyla.train.optim.muon import Muon

# Rows not divisible by 2 or 4 (padding), tall and wide, three of one shape (batched NS).
SHAPES = [(10, 6), (7, 12), (16, 8), (16, 8), (16, 8), (24, 40), (3, 5)]
STEPS = 3



def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.05) for s in SHAPES]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _check(rank, world, group):
    """Run both strategies on ``group`` and compare them with single-device Muon."""
    ref = _params()
    ref_opt = Muon(ref, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    results = {}
    for strategy in ("all_gather", "all_to_all"):
        params = _params()
        opt = DistMuon(params, strategy=strategy, group=group, lr=0.02, weight_decay=0.1,
                       ns_dtype=torch.float32)
        for step in range(STEPS):
            grads = _grads(step)
            if strategy == "all_gather":
                for p, g in zip(params, grads, strict=True):
                    p.grad = g  # full gradient: step() cuts this rank's rows
                opt.step()
            else:  # the reduce-scatter path: only this rank's padded rows are passed
                opt.step([shard_rows(g, rank, world) for g in grads])
        results[strategy] = (params, opt)
    for step in range(STEPS):
        for p, g in zip(ref, _grads(step), strict=True):
            p.grad = g
        ref_opt.step()
    plans = {}
    for strategy, (params, opt) in results.items():
        for p, q in zip(params, ref, strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, s=strategy: f"{s}: {m}")
        plan = planned_traffic(SHAPES, world, strategy, element_size=4)[rank]
        got = opt.counter.totals()["optimizer"]
        assert got["sent"] == STEPS * plan["sent"], (strategy, got, plan)
        assert got["received"] == STEPS * plan["received"], (strategy, got, plan)
        assert opt.ns_flops_total == STEPS * plan["ns_flops"], strategy
        assert got["calls"] == STEPS * (1 if strategy == "all_gather" else 2)
        per_step = opt.comm_per_step()
        assert per_step["bytes_sent"] == plan["sent"]
        assert per_step["param_sync_bytes_sent"] > 0  # counted apart from the optimizer's
        plans[strategy] = plan
    # Two ranks: all-to-all moves W/2 = 1x the bytes on average; more ranks, less.
    if world > 2:
        assert plans["all_to_all"]["ns_flops"] < plans["all_gather"]["ns_flops"]


def _worker(rank, world, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        _check(rank, world, None)
        if world > 2:  # the ``group`` argument: a two-rank subgroup of the world
            pair = dist.new_group([0, 1])
            if rank < 2:
                _check(rank, 2, pair)
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_strategies_match_single_device(world):
    # Fork, not spawn: the children inherit torch and torch._dynamo (which every Optimizer
    # imports on construction) instead of importing them four times over on two cores.
    Muon([torch.nn.Parameter(torch.zeros(2, 2))])
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, os.path.join(d, "init")), nprocs=world, join=True,
                           start_method="fork")


def test_sharding_layout():
    assert rows_per_rank(10, 4) == 3
    assert [row_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert row_range(3, 3, 4) == (3, 3)  # past the end: empty, all padding
    t = torch.arange(10.0).view(5, 2)
    rebuilt = torch.cat([shard_rows(t, r, 3) for r in range(3)])[:5]
    assert torch.equal(rebuilt, t)
    with pytest.raises(ValueError, match="rank"):
        row_range(10, 4, 4)


def test_owners_balanced():
    shapes = [(64, 64)] * 8 + [(64, 256)] * 4
    owners = assign_owners(shapes, 4)
    load = [0] * 4
    for s, o in zip(shapes, owners, strict=True):
        load[o] += s[0] * s[1]
    assert max(load) == min(load)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_planned_ratio_is_half_world(world):
    shapes = [(world * 8, 32)] * (3 * world)  # divisible rows, one owner per matrix
    ag = planned_traffic(shapes, world, "all_gather")
    a2a = planned_traffic(shapes, world, "all_to_all")
    mean = lambda rows: sum(r["sent"] + r["received"] for r in rows) / world  # noqa: E731
    assert mean(ag) / mean(a2a) == pytest.approx(world / 2)
    assert ag[0]["ns_flops"] == world * a2a[0]["ns_flops"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="strategy"):
        DistMuon(_params(), strategy="ring")
    with pytest.raises(ValueError, match="strategy"):
        planned_traffic(SHAPES, 2, "ring")
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="process group"):
            DistMuon(_params())


def test_muon_shapes_scale_keeps_ratios():
    from hyla.train.optim.bench import muon_shapes

    full, small = muon_shapes("laplace-3b"), muon_shapes("laplace-3b", 16)
    assert len(full) == len(small) == 240
    assert sum(a * b for a, b in full) == 2_719_678_464
    assert all(a == 16 * c and b == 16 * d for (a, b), (c, d) in zip(full, small, strict=True))
    with pytest.raises(ValueError, match="width_divisor"):
        muon_shapes("debug", 7)


def test_cli_bench_muon_comm_json(capsys):
    import json

    from hyla.cli import main

    assert main(["bench", "muon-comm", "--world", "2", "--preset", "debug", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["world"] == 2 and r["analytic_ratio"] == 1.0 and r["matches_plan"]
    for s in ("all_gather", "all_to_all"):
        assert r["strategies"][s]["bytes_per_rank"] > 0
        assert r["strategies"][s]["ns_flops_per_rank"] > 0
    assert main(["bench", "muon-comm", "--world", "1", "--preset", "debug"]) == 2

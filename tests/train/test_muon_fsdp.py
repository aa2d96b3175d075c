"""ShardedMuon on FSDP2 shards (gloo, 2 ranks): the update equals single-process Muon's and
the bytes equal the plan ``hyla bench muon-comm`` reports; a MoE model (3-D experts, a
buffer) trains under FSDP2 as it does in one process."""

import dataclasses
import json
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.train.config import TrainConfig
from hyla.train.optim import build as optim
from hyla.train.optim.comm import planned_traffic
from hyla.train.optim.muon import Muon
from hyla.train.optim.sharded_muon import ShardedMuon
from hyla.train.strategies import fsdp
from hyla.train.trainer import Trainer

# Odd rows (uneven shards, an empty-ish one), tall and wide, three of one shape (batched NS).
SHAPES = [(10, 6), (7, 12), (16, 8), (16, 8), (16, 8), (24, 40), (3, 5)]
STEPS = 3
MOE = {"moe": {"num_experts": 4, "top_k": 2, "expert_dim": 32, "router": "sigmoid",
               "score_bias": True, "n_group": 2, "topk_group": 1, "shared_dim": 32}}


class Mats(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(*s, generator=g) * 0.05)
                                        for s in SHAPES)


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _muon_check(rank, world):
    mesh = fsdp.device_mesh(world)
    ref = Mats()
    ref_opt = Muon(list(ref.w), lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    for step in range(STEPS):
        for p, g in zip(ref.w, _grads(step), strict=True):
            p.grad = g
        ref_opt.step()
    for strategy in ("all_to_all", "all_gather"):
        model = fully_shard(Mats(), mesh=mesh)
        opt = ShardedMuon(list(model.w), strategy=strategy, group=mesh.get_group(), lr=0.02,
                          weight_decay=0.1, ns_dtype=torch.float32)
        for step in range(STEPS):
            for p, g in zip(model.w, _grads(step), strict=True):
                p.grad = distribute_tensor(g, mesh, [Shard(0)])  # what FSDP reduce-scatters
            opt.step()
        for p, q in zip(model.w, ref.w, strict=True):
            assert p.to_local().shape[0] < q.shape[0]            # this rank holds a shard
            torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)
        plan = planned_traffic(SHAPES, world, strategy, element_size=4)[rank]
        got = opt.counter.totals()["optimizer"]
        assert got["sent"] == STEPS * plan["sent"], (strategy, got, plan)
        assert opt.ns_flops_total == STEPS * plan["ns_flops"]
        assert "param_sync" not in opt.counter.totals()   # FSDP owns the parameters


def _worker(rank, world, root):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank,
                            world_size=world)
    try:
        _muon_check(rank, world)
        Trainer(_moe_run(root, "moe2")).fit(progress=False)
    finally:
        dist.destroy_process_group()


def _moe_run(root, name, **kw) -> TrainConfig:
    return TrainConfig(init=os.path.join(root, "moe"), steps=4, seq_len=32, batch_size=2,
                       save_every=4, eval_batches=1, warmup_steps=1,
                       out=os.path.join(root, name), **kw)


def test_sharded_muon_and_a_moe_model_at_two_ranks():
    patch = pytest.MonkeyPatch()
    patch.setattr(fsdp, "fast_low_precision_matmul", lambda *a, **k: False)
    patch.setattr(optim, "fast_low_precision_matmul", lambda *a, **k: False)
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as root:
            cfg = dataclasses.replace(preset("debug"), ffn_layers="SESE", ffn_options=MOE)
            torch.manual_seed(0)
            save_checkpoint(HylaLM(cfg), os.path.join(root, "moe"))
            Trainer(_moe_run(root, "moe1", grad_accum=2)).fit(progress=False)
            mp.start_processes(_worker, args=(2, root), nprocs=2, join=True,
                               start_method="fork")
            one, two = ([json.loads(ln)["loss"] for ln in open(os.path.join(root, n,
                                                                            "metrics.jsonl"))]
                        for n in ("moe1", "moe2"))
            assert len(two) == 4
            for a, b in zip(one, two, strict=True):
                assert abs(a - b) <= 2e-3 * a, (one, two)
            par = json.load(open(os.path.join(root, "moe2", "run.json")))["parallel"]
            for local in par["param_bytes_local"]:    # experts sharded along dim 0 too
                assert local == pytest.approx(par["param_bytes_total"] / 2, rel=0.02)
    finally:
        patch.undo()

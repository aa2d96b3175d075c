"""MoE routing in training: the aux-loss-free bias update balances a skewed router, the load
entropy and routing-stability metrics, one bias on every rank (2 gloo ranks, FSDP2), and the
metrics of a ``hyla train --preset debug-moe`` run."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyla.cli import main
from hyla.model import HylaLM, preset
from hyla.model.ffn import MoEFFN
from hyla.train.config import TrainConfig
from hyla.train.routing import (
    RoutingMonitor,
    all_reduce_counts,
    balance_experts,
    bias_update,
    load_entropy,
    max_violation,
    moe_layers,
    take_counts,
)
from hyla.train.trainer import Trainer


def skewed_layer(rate: float) -> MoEFFN:
    """debug-moe's layer whose router sends (almost) every token to experts 0 and 1."""
    torch.manual_seed(0)
    cfg = preset("debug-moe")
    cfg = dataclasses.replace(cfg, ffn_options={"moe": cfg.ffn_options["moe"]
                                                | {"balance_rate": rate}})
    moe = MoEFFN(cfg)
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.05)
        moe.router.weight[:2] += 0.05            # with inputs near +1: scores ~0.96 vs ~0.5
    return moe


@pytest.mark.parametrize("rate", [0.0, 0.02])
def test_bias_update_moves_a_skewed_load_towards_uniform(rate):
    moe = skewed_layer(rate)
    h = torch.randn(256, 64) + 1
    entropy = []
    for _ in range(16):                              # a step: route the tokens, then update
        moe(h)
        counts = take_counts(moe)
        assert counts[0].sum().item() == 256 * 2
        entropy.append(load_entropy(counts[0]).item())
        balance_experts(moe, counts)
    assert entropy[0] < 0.35          # two of eight experts take nearly everything (1/3)
    if rate == 0:
        assert entropy[-1] == entropy[0] and not moe.score_bias.any()
    else:
        assert min(entropy[-3:]) > 0.95
        bias = moe.score_bias            # the overloaded two pushed down, the rest up
        assert (bias[:2] < 0).all() and (bias[2:] > bias[:2].max()).all()


def test_bias_update_is_exact_and_the_same_for_the_same_counts():
    counts = torch.tensor([[9, 5, 1, 1], [4, 4, 4, 4]])
    delta = bias_update(counts, 1e-3)
    assert delta.dtype == torch.float32
    assert torch.equal(delta, torch.tensor([[-1e-3, -1e-3, 1e-3, 1e-3], [0, 0, 0, 0]]))
    a, b = skewed_layer(1e-3), skewed_layer(1e-3)
    c = [torch.tensor([30, 2, 0, 0, 5, 5, 5, 1])]
    for _ in range(3):
        balance_experts(a, c)
        balance_experts(b, c)
    assert torch.equal(a.score_bias, b.score_bias)


def test_entropy_and_violation_bounds():
    torch.manual_seed(0)
    counts = torch.randint(0, 50, (64, 8)) * (torch.rand(64, 8) > 0.4)
    e = load_entropy(counts)
    assert ((e >= 0) & (e <= 1)).all()
    assert load_entropy(torch.full((8,), 7)).item() == pytest.approx(1.0)
    assert load_entropy(torch.eye(8, dtype=torch.long)[3] * 40).item() == 0.0
    assert max_violation(torch.full((8,), 7)).item() == 0.0


def test_routing_changed_is_zero_until_the_weights_change():
    torch.manual_seed(0)
    model = HylaLM(preset("debug-moe"))
    ids = torch.randint(0, 256, (1, 64))
    monitor = RoutingMonitor(model, (ids, torch.tensor([0, 30, 64])), every=0)
    first = monitor.snapshot()
    assert first["routing_changed"] == 0.0 and first["routing_changed_layers"] == [0.0] * 4
    assert monitor.after_step(1)["routing_changed"] == 0.0    # a snapshot shows once, then
    assert "routing_changed" not in monitor.after_step(2)      # only after the next one
    with torch.no_grad():
        for m in moe_layers(model):
            m.router.weight.add_(torch.randn_like(m.router.weight) * 0.05)
    changed = monitor.snapshot()
    assert 0 < changed["routing_changed"] <= 1
    assert all(0 < x <= 1 for x in changed["routing_changed_layers"])
    assert monitor.snapshot()["routing_changed"] == 0.0        # the new reference
    assert all(m.expert_counts is None for m in moe_layers(model))   # probes are not counted
    assert model.training


def test_cli_train_debug_moe_writes_the_routing_metrics(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--preset", "debug-moe", "--steps", "2", "--seq-len", "32",
                 "--batch-size", "2", "--vocab-size", "300", "--tokenizer-documents", "5",
                 "--eval-batches", "1", "--out", str(out), "--no-progress"]) == 0
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0 <= r["expert_load_entropy"] <= 1 and len(r["expert_load_entropy_layers"]) == 4
        assert r["expert_max_violation"] >= 0
    assert "routing_changed" not in records[0]          # snapshots: every 16 and the last
    assert 0 <= records[1]["routing_changed"] <= 1
    assert len(records[1]["routing_changed_layers"]) == 4


WORLD = 2


def _worker(rank, world, root):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root / 'init'}", rank=rank,
                            world_size=world)
    try:
        summed = all_reduce_counts([torch.tensor([rank, 1]), torch.tensor([2 * rank])])
        assert [c.tolist() for c in summed] == [[1, 2], [2]]
        cfg = TrainConfig(preset="debug-moe", steps=3, seq_len=32, batch_size=2,
                          vocab_size=300, tokenizer_documents=5, eval_batches=1,
                          save_every=3, out=str(root / "two"))
        trainer = Trainer(cfg)
        trainer.fit(progress=False)
        bias = torch.cat([m.score_bias for m in moe_layers(trainer.model)])
        every = [torch.empty_like(bias) for _ in range(world)]
        dist.all_gather(every, bias)
        sent = trainer.loop.counters[0].totals()["routing"]["sent"]
        (root / f"rank{rank}.json").write_text(json.dumps({
            "same": all(torch.equal(every[0], b) for b in every),
            "moved": bool(bias.abs().max() > 0), "sent": sent}))
    finally:
        dist.destroy_process_group()


def test_every_rank_applies_the_same_bias_update(tmp_path):
    torch.set_num_threads(1)
    mp.start_processes(_worker, args=(WORLD, tmp_path), nprocs=WORLD, join=True,
                       start_method="fork")
    for rank in range(WORLD):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["same"] and r["moved"]
        assert r["sent"] == 3 * 4 * 8 * 8      # 3 steps x 4 layers x 8 int64 counts: ring / 2
    records = [json.loads(ln) for ln in (tmp_path / "two" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and "routing_changed" in records[-1]


def test_resume_restores_the_biases_and_reproduces_the_losses(tmp_path):
    torch.set_num_threads(1)

    def cfg(out):
        return TrainConfig(preset="debug-moe", steps=4, seq_len=32, batch_size=2,
                           vocab_size=300, tokenizer_documents=5, eval_batches=1,
                           save_every=2, out=str(out))

    def losses(run):
        return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl")
                                                  .read_text().splitlines())}

    whole = Trainer(cfg(tmp_path / "whole"))
    whole.fit(progress=False)
    part = Trainer(cfg(tmp_path / "part"))
    part.loop.fit(until=2, progress=False)
    resumed = Trainer(cfg(tmp_path / "part"), resume=tmp_path / "part")
    assert resumed.step == 2
    for a, b in zip(moe_layers(resumed.model), moe_layers(part.model), strict=True):
        assert torch.equal(a.score_bias, b.score_bias) and a.score_bias.any()
    resumed.fit(progress=False)
    a, b = losses(tmp_path / "whole"), losses(tmp_path / "part")
    assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)]

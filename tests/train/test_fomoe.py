"""FoMoE at gloo ranks: R = W equals DiLoCo; each expert averaged over its holders only (4
ranks); a rank holds and sends only its experts; token skipping; checkpoints with every
expert that resume exactly; the bad inputs."""

import datetime
import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyla.model import HylaLM, preset
from hyla.model.ffn.moe import MoEFFN
from hyla.train.checkpointing.replicas import consolidated
from hyla.train.config import TrainConfig
from hyla.train.optim import build as optim
from hyla.train.strategies.diloco import OuterSync, ring_bytes
from hyla.train.strategies.fomoe import expert_placement, held_by, hold_experts, hold_experts_in
from hyla.train.trainer import Trainer

E = 8   # debug-moe's experts


def tiny(out, **kw) -> TrainConfig:
    base = dict(preset="debug-moe", steps=4, seq_len=32, batch_size=2, vocab_size=300,
                tokenizer_documents=5, save_every=2, keep_last=3, eval_batches=1,
                warmup_steps=2, sync_every=2, out=str(out))
    return TrainConfig(**(base | kw))


def records(run) -> dict:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _init(rank, world, root, name):
    torch.set_num_threads(1)
    # a rank whose assertion fails leaves the others in a collective: time out, not hang
    dist.init_process_group("gloo", init_method=f"file://{root / name}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))


def _train(rank, world, root):
    _init(rank, world, root, "init2")
    try:
        Trainer(tiny(root / "diloco", strategy="diloco")).fit(progress=False)
        Trainer(tiny(root / "all", strategy="fomoe", expert_replicas=world)).fit(progress=False)
        one = Trainer(tiny(root / "one", strategy="fomoe", expert_replicas=1))
        assert [m.held for m in one.model.modules() if isinstance(m, MoEFFN)][0] == \
            list(range(rank, E, world))
        one.fit(progress=False)
        if rank == 0:
            shutil.copytree(root / "one", root / "one_again")
        dist.barrier()
        again = Trainer(tiny(root / "x"), resume=root / "one_again" / "ckpt-000002")
        assert again.cfg.expert_replicas == 1 and again.step == 2
        again.fit(progress=False)
        with pytest.raises(ValueError, match="no MoE layer.*--strategy diloco"):
            Trainer(tiny(root / "dense", preset="debug", strategy="fomoe"))
        with pytest.raises(ValueError, match=r"--expert-replicas must be in 1\.\.2"):
            Trainer(tiny(root / "three", strategy="fomoe", expert_replicas=3))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fomoe")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(optim, "fast_low_precision_matmul", lambda *a, **k: False)
        mp.start_processes(_train, args=(2, root), nprocs=2, join=True, start_method="fork")
    yield root


def test_all_replicas_is_diloco(runs):
    a, b = records(runs / "diloco"), records(runs / "all")
    assert [b[s]["loss"] for s in b] == [a[s]["loss"] for s in a]
    assert [b[s]["comm_bytes_per_rank"] for s in b] == [a[s]["comm_bytes_per_rank"] for s in a]


def test_a_rank_holds_and_sends_only_its_experts(runs):
    full = json.loads((runs / "diloco" / "run.json").read_text())["parallel"]
    one = json.loads((runs / "one" / "run.json").read_text())["parallel"]
    assert one["strategy"] == "fomoe" and one["expert_replicas"] == 1
    assert one["experts_held"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert one["placement"] == expert_placement(E, 2, 1)
    model = HylaLM(_moe_cfg())
    per_expert = sum(m.gate_up[0].numel() + m.down[0].numel()
                     for m in model.modules() if isinstance(m, MoEFFN)) * 4
    assert one["param_bytes_total"] == full["param_bytes_total"]
    for local in one["param_bytes_local"]:      # half of the 8 experts are elsewhere
        assert local == full["param_bytes_total"] - E // 2 * per_expert
    for mine, theirs in zip(one["optimizer_bytes"], full["optimizer_bytes"], strict=True):
        assert mine < theirs      # AdamW's two moments of the missing experts
    # only the shared parameters are synced: every expert has one holder
    shared = full["param_bytes_total"] - E * per_expert
    assert one["sync_bytes_per_sync"] == [ring_bytes(shared, 2)] * 2
    rec = records(runs / "one")
    assert rec[2]["comm_bytes_per_rank"][0] - rec[1]["comm_bytes_per_rank"][0] == shared


def test_checkpoints_hold_every_expert_and_resume_exactly(runs):
    full, again = records(runs / "one"), records(runs / "one_again")
    assert [again[s]["loss"] for s in (3, 4)] == [full[s]["loss"] for s in (3, 4)]
    from hyla.model.load import load_model

    model, _ = load_model(str(runs / "one" / "ckpt-000004"))
    moe = [m for m in model.modules() if isinstance(m, MoEFFN)]
    assert moe and all(m.gate_up.shape[0] == E for m in moe)
    ranks = [torch.load(runs / "one" / "ckpt-000004" / f"rank-{r}.pt", weights_only=True)
             for r in range(2)]
    name = next(k for k in ranks[0]["model"] if k.endswith(".gate_up"))
    whole = dict(model.named_parameters())[name]
    for r, state in enumerate(ranks):   # synced at step 4: the rank's rows are the model's
        assert state["model"][name].shape[0] == E // 2
        torch.testing.assert_close(whole[r::2], state["model"][name], rtol=0, atol=0)


def _moe_cfg():
    import dataclasses

    return dataclasses.replace(preset("debug-moe"), vocab_size=300)


def _groups(rank, world, root):
    """4 ranks, R = 2: each rank moves its parameters by rank + 1, then one outer step at lr
    1, momentum 0: the shared ones become the mean over all, each expert the mean over its
    two holders."""
    _init(rank, world, root, "init4")
    try:
        torch.manual_seed(0)
        model = HylaLM(_moe_cfg())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        placement = expert_placement(E, world, 2)
        hold_experts(model, placement, rank)
        sync = OuterSync(model, every=1, lr=1.0, momentum=0.0, placement=placement)
        held = held_by(placement, rank)
        assert held == [e for e in range(E) if e % 2 == rank // 2]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank + 1.0)
        sync.after_step(1)
        for name, p in model.named_parameters():
            if name.endswith((".gate_up", ".down")):
                offsets = torch.tensor([sum(r + 1.0 for r in placement[e]) / 2 for e in held])
                want = before[name][held] + offsets.view(-1, *[1] * (p.ndim - 1))
            else:
                want = before[name] + 2.5
            torch.testing.assert_close(p.data, want, msg=name)
        shared = sum(p.numel() * 4 for n, p in model.named_parameters()
                     if not n.endswith((".gate_up", ".down")))
        experts = sum(p.numel() * 4 for n, p in model.named_parameters()
                      if n.endswith((".gate_up", ".down")))
        sent = sync.counter.totals()["outer_sync"]["sent"]
        assert sent == ring_bytes(shared, 4) + ring_bytes(experts, 2) == sync.sync_bytes()
        whole = consolidated(model, sync, world)
        if rank == 0:
            for name, t in whole.items():
                if name.endswith(".gate_up"):
                    offsets = torch.tensor([1.5 if e % 2 == 0 else 3.5 for e in range(E)])
                    torch.testing.assert_close(t, before[name] + offsets.view(-1, 1, 1))
    finally:
        dist.destroy_process_group()


def test_each_expert_is_averaged_over_its_holders_only(tmp_path):
    mp.start_processes(_groups, args=(4, tmp_path), nprocs=4, join=True, start_method="fork")


def test_token_skipping_drops_pairs_held_elsewhere_and_keeps_the_routed_mass():
    torch.manual_seed(0)
    full = MoEFFN(_moe_cfg())
    h = torch.randn(64, full.gate_up.shape[-1])
    weights, ids = full.route(h)
    layer = hold_experts_in(MoEFFN(_moe_cfg()), [1, 3, 5], token_skipping=True)
    layer.load_state_dict({k: v[[1, 3, 5]] if k in ("gate_up", "down") else v
                           for k, v in full.state_dict().items()})
    held = torch.isin(ids, torch.tensor([1, 3, 5]))
    kept = weights * held
    scaled = kept * weights.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp_min(1e-20)
    want = full.combine_experts(h, ids, scaled)        # the pairs held elsewhere weigh nothing
    torch.testing.assert_close(layer.combine_experts(h, ids, weights), want)
    assert 0 < held.sum() < held.numel()         # some pairs skipped: less expert compute
    # without skipping, every token runs top_k experts, all of them held
    layer.token_skipping = False
    assert torch.isin(layer.route(h)[1], torch.tensor([1, 3, 5])).all()
    with pytest.raises(ValueError, match="--no-token-skipping .* raise --expert-replicas"):
        hold_experts_in(MoEFFN(_moe_cfg()), [2], token_skipping=False)


def test_bad_placements_are_refused():
    with pytest.raises(ValueError, match=r"--expert-replicas must be in 1\.\.4"):
        expert_placement(8, 4, 0)
    with pytest.raises(ValueError, match=r"do not split evenly.*--expert-replicas in \[2, 4\]"):
        expert_placement(6, 4, 1)
    with pytest.raises(ValueError, match="expert_replicas must be >= 1"):
        TrainConfig(strategy="fomoe", expert_replicas=-1)


def test_fomoe_bad_inputs_are_refused_in_one_process_too(tmp_path):
    with pytest.raises(ValueError, match="no MoE layer"):
        Trainer(tiny(tmp_path / "dense", preset="debug", strategy="fomoe"))
    with pytest.raises(ValueError, match=r"--expert-replicas must be in 1\.\.1"):
        Trainer(tiny(tmp_path / "two", strategy="fomoe", expert_replicas=2))

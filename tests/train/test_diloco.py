"""DiLoCo at two gloo ranks: equal to data parallelism at H = 1, outer lr 1, momentum 0 (with a
linear inner optimizer); the bytes of every sync; exact resume at the same world size only."""

import datetime
import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyla.train.config import TrainConfig
from hyla.train.optim import build as optim
from hyla.train.strategies import base as strategy_base
from hyla.train.strategies import diloco
from hyla.train.strategies.diloco import OuterSync, ring_bytes
from hyla.train.trainer import Trainer

WORLD = 2


def tiny(out, **kw) -> TrainConfig:
    base = dict(preset="debug", steps=6, seq_len=32, batch_size=2, vocab_size=300,
                tokenizer_documents=5, save_every=3, keep_last=3, eval_batches=1,
                warmup_steps=2, out=str(out))
    return TrainConfig(**(base | kw))


def records(run) -> dict:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def sgd(model, cfg):   # linear in the gradient: averaging parameters = averaging gradients
    return [torch.optim.SGD(model.parameters(), lr=cfg.lr)]


# H = 1, outer lr 1, momentum 0, no clipping, SGD inside: a data-parallel step
DP = dict(strategy="diloco", sync_every=1, outer_lr=1.0, outer_momentum=0.0, clip=0.0, lr=0.05)


def _worker(rank, world, root):
    torch.set_num_threads(1)
    # a rank whose assertion fails leaves the other in a collective: time out, not hang
    dist.init_process_group("gloo", init_method=f"file://{root / 'init'}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(diloco, "run_optimizers", sgd)
            Trainer(tiny(root / "dp2", **DP)).fit(progress=False)
        # Muon + AdamW inside, Nesterov outside, a checkpoint mid-interval (step 3 of H = 2)
        run = Trainer(tiny(root / "dil", strategy="diloco", sync_every=2))
        run.fit(progress=False)
        assert run.strategy.sync.sync_bytes() == _synced_bytes(run.model)
        if rank == 0:
            shutil.copytree(root / "dil", root / "dil_again")
        dist.barrier()
        again = Trainer(tiny(root / "x"), resume=root / "dil_again" / "ckpt-000003")
        assert again.cfg.strategy == "diloco" and again.step == 3
        again.fit(progress=False)
    finally:
        dist.destroy_process_group()


def _synced_bytes(model) -> int:
    """What one DiLoCo sync sends a rank at W = 2: every parameter once (ring all-reduce)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("diloco")
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(strategy_base, "run_optimizers", sgd)
        # one process, the same global batch: 2 micro-batches of the two ranks' blocks
        Trainer(tiny(root / "dp1", **DP, grad_accum=2)).fit(progress=False)
    patch = pytest.MonkeyPatch()
    patch.setattr(optim, "fast_low_precision_matmul", lambda *a, **k: False)
    try:
        mp.start_processes(_worker, args=(WORLD, root), nprocs=WORLD, join=True,
                           start_method="fork")
    finally:
        patch.undo()
    yield root


def test_h1_outer_lr1_momentum0_is_data_parallelism(runs):
    one, two = records(runs / "dp1"), records(runs / "dp2")
    assert sorted(two) == list(range(1, 7))
    for s in one:
        assert abs(two[s]["loss"] - one[s]["loss"]) <= 1e-4 * abs(one[s]["loss"]), s
    from hyla.model.load import load_model

    a, _ = load_model(str(runs / "dp1" / "ckpt-000006"))
    b, _ = load_model(str(runs / "dp2" / "ckpt-000006"))
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)


def test_comm_bytes_are_the_synced_tensors(runs):
    from hyla.model.load import load_model

    model, _ = load_model(str(runs / "dil" / "ckpt-000006"))
    expect = _synced_bytes(model)           # a ring all-reduce at W = 2 sends n of n bytes
    rec = records(runs / "dil")
    for s, r in rec.items():   # syncs after steps 2, 4, 6; nothing in between
        assert r["comm_bytes_per_rank"] == [expect if s % 2 == 0 else 0] * WORLD, s
    parallel = json.loads((runs / "dil" / "run.json").read_text())["parallel"]
    assert parallel["strategy"] == "diloco" and parallel["world_size"] == WORLD
    assert parallel["param_bytes_local"] == [parallel["param_bytes_total"]] * WORLD
    assert parallel["sync_bytes_per_sync"] == [expect] * WORLD
    assert parallel["syncs"] == 3 and "experts_held" not in parallel


def test_resume_is_exact_at_the_same_world_size(runs):
    full, again = records(runs / "dil"), records(runs / "dil_again")
    assert [again[s]["loss"] for s in (4, 5, 6)] == [full[s]["loss"] for s in (4, 5, 6)]
    ckpt = runs / "dil" / "ckpt-000006"
    assert {"rank-0.pt", "rank-1.pt", "model.safetensors"} <= {p.name for p in ckpt.iterdir()}


def test_another_world_size_is_refused(runs):
    with pytest.raises(ValueError, match="diloco checkpoint of 2 ranks.*--nproc-per-node 2"):
        Trainer(tiny(runs / "x1"), resume=runs / "dil" / "ckpt-000006")


def test_one_process_outer_step_is_nesterov_sgd():
    m = torch.nn.Linear(2, 1, bias=False)
    m.weight.data[:] = 1.0
    sync = OuterSync(m, every=2, lr=0.5, momentum=0.9)
    m.weight.data[:] = 3.0
    sync.after_step(1)                        # not due
    assert m.weight.data.tolist() == [[3.0, 3.0]]
    sync.after_step(2)                        # pseudo-gradient -2, momentum buffer -2
    # Nesterov: update = g + 0.9 * buf = -3.8; anchor 1 - 0.5 * -3.8 = 2.9
    assert m.weight.data.flatten().tolist() == pytest.approx([2.9, 2.9])
    assert sync.syncs == 1 and ring_bytes(8, 1) == 0


def test_bad_outer_flags():
    with pytest.raises(ValueError, match="outer_momentum"):
        TrainConfig(strategy="diloco", outer_momentum=1.0)
    with pytest.raises(ValueError, match="sync_every"):
        TrainConfig(strategy="diloco", sync_every=0)
    with pytest.raises(ValueError, match="--expert-replicas is fomoe's"):
        TrainConfig(strategy="diloco", expert_replicas=1)


def _dies(rank, world, root):
    import os

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root / 'init_dead'}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=5))
    run = Trainer(tiny(root / "dead", strategy="diloco", sync_every=2, save_every=2, steps=4,
                       sync_timeout=5))
    if rank == 1:       # trains to its checkpoint at step 2, then dies
        run.loop.fit(until=2, progress=False)
        os._exit(0)
    try:
        run.fit(progress=False)
    except RuntimeError as e:
        (root / "stopped.txt").write_text(str(e))
    os._exit(0)     # the process group is broken: nothing to tear down


def test_a_dead_rank_stops_the_run_naming_it_with_the_checkpoint_intact(tmp_path):
    from hyla.train.checkpointing import load_train_state

    mp.start_processes(_dies, args=(WORLD, tmp_path), nprocs=WORLD, join=True,
                       start_method="fork")
    why = (tmp_path / "stopped.txt").read_text()
    assert "rank 0 stopped after step 2: rank(s) 1 stopped answering" in why, why
    assert "ckpt-000002) is intact" in why
    assert load_train_state(tmp_path / "dead")["step"] == 2

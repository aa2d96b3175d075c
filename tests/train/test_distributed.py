"""Two gloo ranks train the debug preset: replicas agree, loss falls, strategies match, resume
continues exactly and refuses another world size."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyla.train import distributed
from hyla.train.config import TrainConfig
from hyla.train.muon import Muon
from hyla.train.trainer import Trainer

WORLD = 2


def tiny(out, **kw) -> TrainConfig:
    base = dict(preset="debug", steps=6, seq_len=32, batch_size=2, vocab_size=300,
                tokenizer_documents=5, save_every=3, eval_batches=1, warmup_steps=2,
                out=str(out))
    return TrainConfig(**(base | kw))


def losses(run) -> dict:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank, world, root):
    torch.set_num_threads(1)  # two ranks on two shared cores: extra threads only wait
    dist.init_process_group("gloo", init_method=f"file://{root / 'init'}", rank=rank,
                            world_size=world)
    try:
        out = {}
        for strategy in ("all_to_all", "all_gather"):
            t = Trainer(tiny(root / strategy, muon_strategy=strategy))
            t.fit(progress=False)
            out[strategy] = _params(t.model)
        # Interrupted after 3 steps (a checkpoint is written at step 3), then resumed.
        part = Trainer(tiny(root / "part", steps=3))
        part.fit(progress=False)
        resumed = Trainer(tiny(root / "part"), resume=root / "part")
        out["resumed_step"] = resumed.step
        resumed.fit(progress=False)
        out["resumed"] = _params(resumed.model)
        torch.save(out, root / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run the two-rank trainings once; yields (root, per-rank results)."""
    root = tmp_path_factory.mktemp("dist")
    # fp32 Newton-Schulz on every CPU, so the two strategies can be compared tightly.
    mp_patch = pytest.MonkeyPatch()
    mp_patch.setattr(distributed, "fast_low_precision_matmul", lambda *a, **k: False)
    Muon([torch.nn.Parameter(torch.zeros(2, 2))])  # import dynamo once, before forking
    try:
        # Fork: the children inherit the imports (and the patch) instead of redoing them.
        mp.start_processes(_worker, args=(WORLD, root), nprocs=WORLD, join=True,
                           start_method="fork")
    finally:
        mp_patch.undo()
    yield root, [torch.load(root / f"rank{r}.pt") for r in range(WORLD)]


def test_ranks_hold_identical_parameters(runs):
    _, (r0, r1) = runs
    for key in ("all_to_all", "all_gather", "resumed"):
        for name, p in r0[key].items():
            assert torch.equal(p, r1[key][name]), (key, name)


def test_loss_goes_down_and_rank_zero_logs_the_global_batch(runs):
    root, _ = runs
    run = root / "all_to_all"
    loss = losses(run)
    assert sorted(loss) == list(range(1, 7))  # one line a step: rank 0 alone writes
    assert loss[6] < loss[1] - 0.3, loss
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["tokens"] == 6 * WORLD * 32 * 2  # W x batch_size x seq_len a step
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-000003", "ckpt-000006"]
    assert not list(run.glob(".ckpt-*"))  # no temporary directory left behind


def test_strategies_give_the_same_parameters(runs):
    _, (r0, _) = runs
    for name, p in r0["all_to_all"].items():
        torch.testing.assert_close(p, r0["all_gather"][name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_resume_continues_the_two_rank_run_exactly(runs):
    root, (r0, _) = runs
    assert r0["resumed_step"] == 3
    whole, part = losses(root / "all_to_all"), losses(root / "part")
    assert [whole[s] for s in range(1, 7)] == [part[s] for s in range(1, 7)]
    for name, p in r0["all_to_all"].items():
        assert torch.equal(p, r0["resumed"][name]), name


def test_resume_with_another_world_size_is_rejected(runs):
    root, _ = runs
    with pytest.raises(ValueError, match="world size 2, not 1.*nproc-per-node 2"):
        Trainer(tiny(root / "all_to_all"), resume=root / "all_to_all")
    # and a single-process checkpoint (no world size recorded) under two ranks
    with pytest.raises(ValueError, match="world size 1, not 2.*plain"):
        distributed.check_resume_world({"data_position": {"epoch": 0, "doc": 0, "offset": 0}},
                                       2, "run")


def test_strided_blocks_partition_the_stream():
    class Count:
        def __init__(self):
            self.i = 0

        def __next__(self):
            self.i += 1
            return self.i - 1

        def position(self):
            return {"epoch": 0, "doc": self.i, "offset": 0}

    shares = [distributed.StridedBlocks(Count(), rank=r, world=3) for r in range(3)]
    taken = [[next(s) for _ in range(4)] for s in shares]
    assert sorted(sum(taken, [])) == list(range(12))
    assert {s.position()["doc"] for s in shares} == {12}  # one position resumes every rank
    with pytest.raises(ValueError, match="rank"):
        distributed.StridedBlocks(Count(), rank=3, world=3)


def test_bad_muon_strategy():
    with pytest.raises(ValueError, match="muon_strategy"):
        TrainConfig(muon_strategy="ring")

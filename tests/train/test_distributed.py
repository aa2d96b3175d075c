"""FSDP2 at two gloo ranks against one process with the same global batch: equal losses, half
the bytes a rank, checkpoints that resume at the other world size, missing shards refused."""

import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyla.train import process_group as distributed
from hyla.train.checkpointing import load_train_state
from hyla.train.config import TrainConfig
from hyla.train.optim import build as optim
from hyla.train.strategies import fsdp
from hyla.train.trainer import Trainer

WORLD = 2
STEPS = 12


def tiny(out, **kw) -> TrainConfig:
    base = dict(preset="debug", steps=STEPS, seq_len=32, batch_size=2, vocab_size=300,
                tokenizer_documents=5, save_every=6, keep_last=3, eval_batches=1,
                warmup_steps=2, out=str(out))
    return TrainConfig(**(base | kw))


def losses(run) -> dict:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def close(a: dict, b: dict, steps) -> None:
    for s in steps:
        assert abs(a[s] - b[s]) <= 2e-3 * abs(b[s]), (s, a[s], b[s])


def _worker(rank, world, root):
    torch.set_num_threads(1)  # two ranks on two shared cores: extra threads only wait
    dist.init_process_group("gloo", init_method=f"file://{root / 'init'}", rank=rank,
                            world_size=world)
    try:
        # Activation checkpointing on: FSDP's gathered blocks are recomputed in backward.
        Trainer(tiny(root / "two", activation_checkpointing=True)).fit(progress=False)
        # Muon's other exchange, and accumulation: 2 ranks x 1 block x 2 micro-batches.
        Trainer(tiny(root / "two_gather", muon_strategy="all_gather", steps=3, save_every=3,
                     batch_size=1, grad_accum=2)).fit(progress=False)
        if rank == 0:   # resumed at the world size that wrote it
            shutil.copytree(root / "two", root / "two_again")
        dist.barrier()
        Trainer(tiny(root / "x"), resume=root / "two_again" / "ckpt-000006").fit(progress=False)
        # A run written at one rank (by the parent) resumes here at two.
        resumed = Trainer(tiny(root / "one_then_two"), resume=root / "one_then_two"
                          / "ckpt-000006")
        assert resumed.cfg.grad_accum == 1 and resumed.step == 6
        resumed.fit(progress=False)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process with 2 x 2 blocks a step, then two ranks with 2 blocks each."""
    root = tmp_path_factory.mktemp("fsdp")
    patch = pytest.MonkeyPatch()
    # fp32 Newton-Schulz on every CPU, so one and two ranks can be compared tightly.
    patch.setattr(fsdp, "fast_low_precision_matmul", lambda *a, **k: False)
    patch.setattr(optim, "fast_low_precision_matmul", lambda *a, **k: False)
    torch.set_num_threads(1)
    try:
        Trainer(tiny(root / "one", grad_accum=2)).fit(progress=False)
        part = Trainer(tiny(root / "one_then_two", grad_accum=2))
        part.loop.fit(until=6, progress=False)
        # Fork: the children inherit the imports (and the patches) instead of redoing them.
        mp.start_processes(_worker, args=(WORLD, root), nprocs=WORLD, join=True,
                           start_method="fork")
        # ... and a run written at two ranks resumes here at one (grad_accum becomes 2).
        shutil.copytree(root / "two", root / "two_then_one")
        back = Trainer(tiny(root / "x"), resume=root / "two_then_one" / "ckpt-000006")
        assert back.cfg.grad_accum == 2 and back.step == 6
        back.fit(progress=False)
    finally:
        patch.undo()
    yield root


def test_two_ranks_match_one_process_with_the_same_global_batch(runs):
    one, two = losses(runs / "one"), losses(runs / "two")
    assert sorted(two) == list(range(1, STEPS + 1))  # rank 0 alone writes
    close(two, one, range(1, STEPS + 1))
    assert one[STEPS] < one[1] - 0.3
    close(losses(runs / "two_gather"), one, range(1, 4))
    last = json.loads((runs / "two" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["tokens"] == STEPS * WORLD * 32 * 2
    assert last["comm_bytes"] > 0 and len(last["comm_bytes_per_rank"]) == WORLD


def test_each_rank_holds_half_the_parameters_and_optimizer_state(runs):
    one = json.loads((runs / "one" / "run.json").read_text())["parallel"]
    two = json.loads((runs / "two" / "run.json").read_text())["parallel"]
    assert two["strategy"] == "fsdp" and two["world_size"] == WORLD
    assert two["mesh"]["shape"] == [WORLD] and two["mesh"]["device_type"] == "cpu"
    assert two["param_bytes_total"] == one["param_bytes_total"]
    for local in two["param_bytes_local"]:
        assert local == pytest.approx(two["param_bytes_total"] / WORLD, rel=0.02)
    for local in two["optimizer_bytes"]:
        assert local == pytest.approx(one["optimizer_bytes"][0] / WORLD, rel=0.02)
    assert len(two["peak_memory_bytes"]) == WORLD and min(two["peak_memory_bytes"]) > 0


def test_checkpoints_resume_at_the_other_world_size(runs):
    one, two = losses(runs / "one"), losses(runs / "two")
    later = range(7, STEPS + 1)
    again = losses(runs / "two_again")
    assert [again[s] for s in later] == [two[s] for s in later]   # same world: bit for bit
    close(losses(runs / "one_then_two"), one, later)     # written at 1, resumed at 2
    close(losses(runs / "two_then_one"), two, later)     # written at 2, resumed at 1
    ckpt = runs / "two" / "ckpt-000012"
    assert sorted(p.name for p in (ckpt / "dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    from hyla.model.load import load_model

    model, _ = load_model(str(ckpt))     # the consolidated single-file model
    total = json.loads((runs / "two" / "run.json").read_text())["parallel"]["param_bytes_total"]
    assert model.num_parameters() * 4 == total


def test_a_missing_shard_is_refused_naming_the_file(runs, capsys):
    run = runs / "broken"
    shutil.copytree(runs / "two", run)
    (run / "ckpt-000012" / "dcp" / "__1_0.distcp").unlink()
    state = load_train_state(run)
    assert state["step"] == 6
    assert "skipped ckpt-000012 (ValueError: shard dcp/__1_0.distcp is missing)" in \
        capsys.readouterr().err
    (run / "ckpt-000006" / "dcp" / "__0_0.distcp").write_bytes(b"cut")
    with pytest.raises(ValueError, match=r"__1_0.distcp is missing.*__0_0.distcp is truncated"):
        load_train_state(run)


def test_a_resume_that_cannot_keep_the_global_batch_names_the_flags():
    run = TrainConfig(batch_size=2, grad_accum=3)
    assert distributed.resume_batch(run, 2, None, 3, "r").grad_accum == 2
    asked = TrainConfig(batch_size=3)
    assert distributed.resume_batch(run, 2, asked, 2, "r").grad_accum == 2
    with pytest.raises(ValueError, match="global batch of 12 .*--batch-size B and --grad-accum"):
        distributed.resume_batch(run, 2, None, 5, "r")
    with pytest.raises(ValueError, match="world size 4 x --batch-size 2 x --grad-accum 3"):
        distributed.resume_batch(TrainConfig(batch_size=2, grad_accum=3), 4,
                                 TrainConfig(grad_accum=5), 4, "r")


def test_strided_blocks_partition_the_stream_by_micro_batch():
    class Count:
        def __init__(self):
            self.i = 0

        def __next__(self):
            self.i += 1
            return self.i - 1

        def position(self):
            return {"epoch": 0, "doc": self.i, "offset": 0}

    shares = [distributed.StridedBlocks(Count(), rank=r, world=3, chunk=2) for r in range(3)]
    taken = [[next(s) for _ in range(4)] for s in shares]
    assert taken[1] == [2, 3, 8, 9]          # micro-batches 1 and 4 of the stream
    assert sorted(sum(taken, [])) == list(range(12))
    assert {s.position()["doc"] for s in shares} == {12}  # one position resumes every rank
    with pytest.raises(ValueError, match="rank"):
        distributed.StridedBlocks(Count(), rank=3, world=3)


def test_bad_strategy_flags():
    with pytest.raises(ValueError, match="muon_strategy"):
        TrainConfig(muon_strategy="ring")
    assert TrainConfig(strategy="diloco").sync_every == 16   # built now (tests/train/test_diloco)
    with pytest.raises(ValueError, match="strategy must be one of"):
        TrainConfig(strategy="ddp")


def test_mixed_precision_follows_the_flag_where_bf16_is_fast(monkeypatch):
    bf16 = TrainConfig(precision="bf16")
    monkeypatch.setattr(fsdp, "fast_low_precision_matmul", lambda *a, **k: True)
    policy = fsdp.mixed_precision(bf16, "cpu")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp.mixed_precision(TrainConfig(), "cpu").param_dtype is None   # fp32 run
    monkeypatch.setattr(fsdp, "fast_low_precision_matmul", lambda *a, **k: False)
    assert fsdp.mixed_precision(bf16, "cpu").param_dtype is None     # emulated bf16


def test_one_process_run_json_and_device_flag(runs):
    par = json.loads((runs / "one" / "run.json").read_text())["parallel"]
    assert par["strategy"] == "single" and par["world_size"] == 1 and par["mesh"] is None
    assert par["param_bytes_local"] == [par["param_bytes_total"]]
    with pytest.raises(ValueError, match="device must be one of"):
        TrainConfig(device="tpu")

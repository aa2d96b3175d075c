"""The gated delta rule layers (D: one decay a head, K: one a key channel) everywhere a layer
letter goes: training, prefill/decode, the engine (chunking, prefix-cache snapshots,
prefill-only hand-over), SequenceState and the memory arithmetic, checkpoints, the
simulator's sizes and distillation."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from layer_checks import (
    check_engine_greedy_matches_model_loop,
    check_prefill_only_hand_over,
    check_prefix_cache_snapshots,
)

from hyla.disagg.sim.hardware import spec_from_config
from hyla.eval.memory import memory_report, state_bytes
from hyla.model import MIXERS, HylaLM, SequenceState, preset
from hyla.model.formats.checkpoint import load_checkpoint, save_checkpoint
from hyla.model.mixers.deltanet import CONV_KERNEL, GatedDeltaMixer, KDAMixer
from hyla.ops.short_conv import causal_conv
from hyla.train.distill.student import build_student, transfer_layers


def _model(layers, seed=0):
    torch.manual_seed(seed)
    return HylaLM(dataclasses.replace(preset("debug"), layers=layers)).eval()


def test_registered():
    assert MIXERS["D"] is GatedDeltaMixer and MIXERS["K"] is KDAMixer
    model = _model("GDKA")
    assert isinstance(model.blocks[1].mixer, GatedDeltaMixer)
    assert model.blocks[2].mixer.per_channel and not model.blocks[1].mixer.per_channel
    assert model.blocks[1].mixer.layer_idx == 1


@pytest.mark.parametrize("layers", ["GDA", "KDK"])
def test_forward_equals_prefill_then_decode(layers):
    model = _model(layers)
    ids = torch.randint(0, 256, (41,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids[None])[0]
    st = model.new_state()
    torch.testing.assert_close(model.prefill(ids[:2], st), full[:2], atol=1e-4, rtol=1e-4)
    # a second chunk shorter than the conv window, then a long one
    torch.testing.assert_close(model.prefill(ids[2:4], st), full[2:4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.prefill(ids[4:33], st), full[4:33], atol=1e-4, rtol=1e-4)
    other = model.new_state()
    model.prefill(ids[:5], other)
    for t in range(33, 41):
        step = model.decode(ids[t:t + 1].repeat(2), [st, other])   # batched with another
        torch.testing.assert_close(step[0], full[t], atol=1e-4, rtol=1e-4)
    assert st.num_tokens == 41 and other.num_tokens == 13


@pytest.mark.parametrize("layers", ["DD", "KK"])
def test_packed_documents_are_independent(layers):
    model = _model(layers)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = model(ids, cu_seqlens=torch.tensor([0, 1, 17, 40]))[0]
        for a, b in [(0, 1), (1, 17), (17, 40)]:
            torch.testing.assert_close(packed[a:b], model(ids[:, a:b])[0], atol=1e-5,
                                       rtol=1e-5)


def test_trains_one_step_every_parameter_moves():
    model = _model("DKA").train()
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        for name, p in model.blocks[:2].named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("layers", ["GDA", "DKD"])
@pytest.mark.parametrize("cfg", [dict(), dict(max_num_batched_tokens=24, snapshot_interval=16,
                                              max_num_seqs=3)], ids=["plain", "chunked"])
def test_engine_greedy_matches_model_loop(layers, cfg):
    check_engine_greedy_matches_model_loop(_model(layers), 4, **cfg)


def test_prefix_cache_snapshots_carry_the_conv_window():
    check_prefix_cache_snapshots(_model("GDA"), 5)


def test_prefill_only_state_ships_and_decodes_like_local():
    check_prefill_only_hand_over(_model("DKA"), 6)


def test_state_bytes_memory_and_simulator_count_the_conv_window():
    cfg = dataclasses.replace(preset("debug"), layers="GDKA")
    model = _model("GDKA")
    st = model.new_state()
    model.prefill(torch.arange(17), st)
    matrix = cfg.n_heads * cfg.head_k_dim * cfg.head_v_dim * 4
    conv = (CONV_KERNEL - 1) * (2 * cfg.key_dim + cfg.value_dim) * 4
    by_kind = st.bytes_by_kind()
    assert by_kind["gated_delta"] == by_kind["kda"] == matrix + conv
    want = state_bytes(cfg, 17, kv_dtype=torch.float32)
    assert st.nbytes == want["total"] and want["gated_delta"] == matrix + conv
    assert SequenceState.unflatten(st.flatten()).nbytes == st.nbytes
    report = memory_report(cfg, 17)
    assert report["layers"]["gated_delta"] == report["layers"]["kda"] == 1
    assert {r["label"] for r in report["kinds"]} >= {"Gated DeltaNet", "KDA"}
    sim = spec_from_config(cfg)
    assert sim.state_bytes == state_bytes(cfg, 1)["fixed"]
    assert sim.linear_token_flops == GatedDeltaMixer.token_flops(cfg) * 2 + \
        MIXERS["G"].token_flops(cfg)


def test_checkpoint_round_trip(tmp_path):
    model = _model("DKGA")
    save_checkpoint(model, tmp_path / "ck")
    loaded, _ = load_checkpoint(tmp_path / "ck")
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_distillation_initialises_from_attention():
    torch.manual_seed(0)
    teacher = HylaLM(dataclasses.replace(preset("debug"), layers="AAAA", n_kv_heads=2)).eval()
    student = build_student(teacher, "DKGA")
    assert transfer_layers(teacher.cfg, student.cfg) == [0, 1, 2]
    for i in (0, 1):
        s, t = student.blocks[i].mixer, teacher.blocks[i].mixer
        assert torch.equal(s.q_proj.weight, t.q_proj.weight)
        assert torch.equal(s.o_proj.weight, t.o_proj.weight)
        k = s.k_proj.weight.view(4, 16, 64)
        assert torch.equal(k[1], t.k_proj.weight.view(2, 16, 64)[0])
        # the conv passes the current token through; decays slow and input-independent
        qkv = torch.randn(1, 5, s.conv.in_channels)
        assert torch.equal(causal_conv(qkv, s.conv.weight[:, 0])[0], qkv)
        x = torch.randn(1, 5, 64)
        tau = -1 / s.log_decay(x)
        assert 15 < tau.min() and tau.max() < 4200
        assert torch.allclose(tau[0, 0], tau[0, 1])
    with torch.no_grad():
        ids = torch.randint(0, 256, (1, 12))
        assert torch.isfinite(student(ids)).all()


def test_bf16_model_prefill_then_decode():
    model = _model("DK").to(torch.bfloat16)
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = model(ids[None])[0].float()
    st = model.new_state()
    assert st.tensors[0][1].dtype == torch.bfloat16 and st.tensors[0][0].dtype == torch.float32
    pre = model.prefill(ids[:15], st).float()
    torch.testing.assert_close(pre, full[:15], atol=0.05, rtol=0.05)
    for t in range(15, 20):
        torch.testing.assert_close(model.decode(ids[t:t + 1], [st])[0].float(), full[t],
                                   atol=0.05, rtol=0.05)


def test_distill_runs_with_delta_layers(tmp_path):
    from hyla.train.distill import Distiller
    from hyla.train.distill.config import DistillConfig

    torch.manual_seed(0)
    teacher = HylaLM(dataclasses.replace(preset("debug"), layers="AAAA", n_kv_heads=2)).eval()
    save_checkpoint(teacher, tmp_path / "teacher")
    cfg = DistillConfig(teacher=str(tmp_path / "teacher"), layers="DKGA", stage1_steps=2,
                        stage2_steps=1, seq_len=32, batch_size=2, warmup_steps=0,
                        eval_batches=1, save_every=100, out=str(tmp_path / "out"),
                        vocab_chunk=40, optimizer="adamw")
    Distiller(cfg).fit(progress=False)
    student, _ = load_checkpoint(tmp_path / "out")
    assert student.cfg.layers == "DKGA"

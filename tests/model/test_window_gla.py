"""Linearised attention (G with linear_window): the teacher's projections, an exact window +
sinks, a normalised GLA branch. Everywhere a layer goes: training, prefill/decode, the engine
(chunking, prefix-cache snapshots, prefill-only hand-over), SequenceState and the memory
arithmetic, checkpoints, the simulator, export refusals, distillation's calibration."""

import dataclasses

import pytest
import torch
from layer_checks import (
    check_engine_greedy_matches_model_loop,
    check_prefill_only_hand_over,
    check_prefix_cache_snapshots,
)

from hyla.disagg.sim.hardware import spec_from_config
from hyla.eval.memory import state_bytes
from hyla.model import HylaLM, SequenceState, preset
from hyla.model.formats.checkpoint import load_checkpoint, save_checkpoint
from hyla.model.mixers import GLAMixer, WindowedGLAMixer
from hyla.model.mixers.linearised.gla import hedgehog
from hyla.train.distill.student import build_student


def _model(layers="GGAG", window=5, sinks=2, seed=0, perturb=True):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(preset("debug"), layers=layers, linear_window=window,
                              window_sinks=sinks)
    model = HylaLM(cfg).eval()
    if perturb:             # new parameters off their identity / constant start
        with torch.no_grad():
            for block in model.blocks:
                m = block.mixer
                if isinstance(m, WindowedGLAMixer):
                    m.mix_proj.weight.normal_(0, 0.3)
                    m.q_map.add_(torch.randn_like(m.q_map) * 0.5)
                    m.gk_proj[1].weight.normal_(0, 0.3)
    return model


def test_g_with_a_window_builds_the_linearised_form():
    model = _model()
    assert type(model.blocks[0].mixer) is WindowedGLAMixer
    assert isinstance(model.blocks[0].mixer, GLAMixer)
    assert type(HylaLM(preset("debug")).blocks[0].mixer) is GLAMixer
    spec = GLAMixer.state_spec(model.cfg)
    assert spec.names == ("state", "window_keys", "window_values", "sink_keys", "sink_values")
    assert spec.per_token == ()                      # constant size, whatever the context


@pytest.mark.parametrize("window,sinks", [(5, 2), (3, 0), (16, 4)])
def test_forward_equals_prefill_then_decode(window, sinks):
    model = _model(window=window, sinks=sinks)
    ids = torch.randint(0, 256, (41,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids[None])[0]
    st = model.new_state()
    # chunks shorter than the sinks, than the window, and longer than both
    for a, b in [(0, 1), (1, 3), (3, 7), (7, 33)]:
        torch.testing.assert_close(model.prefill(ids[a:b], st), full[a:b], atol=1e-4,
                                   rtol=1e-4)
    other = model.new_state()
    model.prefill(ids[:2], other)
    for t in range(33, 41):
        step = model.decode(ids[t:t + 1].repeat(2), [st, other])     # batched with another
        torch.testing.assert_close(step[0], full[t], atol=1e-4, rtol=1e-4)
    assert st.num_tokens == 41 and other.num_tokens == 10


def test_decode_from_the_first_token():
    model = _model()
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids[None])[0]
    st = model.new_state()
    model.prefill(ids[:1], st)
    for t in range(1, 12):                       # sinks and ring filled by decode alone
        torch.testing.assert_close(model.decode(ids[t:t + 1], [st])[0], full[t], atol=1e-4,
                                   rtol=1e-4)


def test_packed_documents_are_independent():
    model = _model("GG")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = model(ids, cu_seqlens=torch.tensor([0, 1, 17, 40]))[0]
        for a, b in [(0, 1), (1, 17), (17, 40)]:
            torch.testing.assert_close(packed[a:b], model(ids[:, a:b])[0], atol=1e-5,
                                       rtol=1e-5)


def test_trains_and_every_parameter_gets_a_gradient():
    model = _model("GA").train()
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(4))
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1),
                                             ids[:, 1:].flatten())
    loss.backward()
    for name, p in model.blocks[0].named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("cfg", [dict(), dict(max_num_batched_tokens=24, snapshot_interval=16,
                                              max_num_seqs=3)], ids=["plain", "chunked"])
def test_engine_greedy_matches_model_loop(cfg):
    check_engine_greedy_matches_model_loop(_model("GAG"), 5, **cfg)


def test_prefix_cache_snapshots_carry_the_window():
    check_prefix_cache_snapshots(_model("GAG"), 6)


def test_prefill_only_state_ships_and_decodes_like_local():
    check_prefill_only_hand_over(_model("GGA"), 7)


def test_state_is_constant_and_counted_everywhere():
    model = _model("GGGA")
    cfg = model.cfg
    st = model.new_state()
    model.prefill(torch.arange(17), st)
    D, H, kv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    one = H * 2 * D * (D + 1) * 4 + 2 * (5 + 2) * kv * D * 4
    assert st.bytes_by_kind()["gla"] == 3 * one
    for n in (17, 8192):
        assert state_bytes(cfg, n, kv_dtype=torch.float32)["gla"] == 3 * one
    assert st.nbytes == state_bytes(cfg, 17, kv_dtype=torch.float32)["total"]
    assert SequenceState.unflatten(st.flatten()).nbytes == st.nbytes
    sim = spec_from_config(cfg)
    assert sim.state_bytes == state_bytes(cfg, 1)["fixed"]
    assert sim.linear_token_flops == 3 * GLAMixer.token_flops(cfg) > 0


def test_checkpoint_round_trip(tmp_path):
    model = _model()
    save_checkpoint(model, tmp_path / "ck")
    loaded, _ = load_checkpoint(tmp_path / "ck")
    assert loaded.cfg.linear_window == 5 and loaded.cfg.window_sinks == 2
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_fla_export_refuses_with_the_field_named(tmp_path):
    from hyla.model.formats.fla import export_fla

    with pytest.raises(ValueError, match="linear_window"):
        export_fla(_model(), None, tmp_path / "out")


@pytest.mark.parametrize("field,value", [("linear_window", -1), ("window_sinks", -2),
                                         ("linear_window", 2.5), ("window_sinks", True)])
def test_config_refuses_bad_windows(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(preset("debug"), **{field: value})


def test_student_takes_the_teachers_projections_and_starts_close():
    torch.manual_seed(0)
    teacher = HylaLM(dataclasses.replace(preset("debug"), layers="AAAA")).eval()
    student = build_student(teacher, "GGAG", window=64, sinks=4).eval()
    for i in (0, 1, 3):
        s, t = student.blocks[i].mixer, teacher.blocks[i].mixer
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.equal(getattr(s, name).weight, getattr(t, name).weight), name
    # within the window the student is the teacher, up to the 10% its linear branch holds
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        a, b = student(ids), teacher(ids)
    assert ((a - b).norm() / b.norm()) < 0.1


def test_smollm2_sized_student_stays_within_five_percent_of_its_parameters():
    from hyla.train.distill.student import student_config

    teacher = dataclasses.replace(
        preset("debug"), vocab_size=49152, d_model=576, layers="A" * 30, n_heads=9,
        n_kv_heads=3, ffn_dim=1536, tie_embeddings=True)
    with torch.device("meta"):
        t = HylaLM(teacher).num_parameters()
        s = HylaLM(student_config(teacher, "G" * 30, window=64)).num_parameters()
    assert s / t < 1.05


def test_calibrate_sets_the_mix_to_the_teachers_window_share():
    cfg = dataclasses.replace(preset("debug"), layers="G", linear_window=4, window_sinks=1)
    layer = GLAMixer(cfg)
    T, H, D = 32, cfg.n_heads, cfg.head_dim
    # all queries equal and keys equal: attention is uniform over the causal prefix
    q = torch.zeros(1, T, H, D)
    k = torch.zeros(1, T, cfg.n_kv_heads, D)
    got = layer.calibrate(q, k, torch.arange(T))
    i = torch.arange(T, dtype=torch.float64)
    share = (torch.minimum(i + 1, torch.full_like(i, 4)) + (i >= 4).double()) / (i + 1)
    torch.testing.assert_close(torch.tensor(got["window_share"], dtype=torch.float64),
                               share.mean().expand(H), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.sigmoid(layer.mix_proj.bias.double()),
                               share.mean().expand(H), atol=1e-5, rtol=1e-5)
    assert all(d >= 4 for d in got["far_distance"])


def test_hedgehog_is_positive_and_normalised():
    x = torch.randn(2, 5, 3, 8)
    f = hedgehog(x, torch.randn(3, 8, 8))
    assert f.shape == (2, 5, 3, 16) and (f > 0).all()
    torch.testing.assert_close(f.sum(-1), torch.full((2, 5, 3), 2.0))


def test_models_copy_and_pickle():
    import copy
    import pickle

    for model in (_model(), HylaLM(preset("debug"))):
        ids = torch.randint(0, 256, (1, 9))
        with torch.no_grad():
            want = model(ids)
            for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
                assert type(other.blocks[0].mixer) is type(model.blocks[0].mixer)
                assert torch.equal(other(ids), want)


def test_dynamic_rope_matches_the_attention_layer_it_replaces():
    cfg = dataclasses.replace(preset("debug"), layers="A", rope_scaling={
        "rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16})
    torch.manual_seed(0)
    teacher = HylaLM(cfg).eval()
    student = build_student(teacher, "G", window=64, sinks=0).eval()
    with torch.no_grad():
        student.blocks[0].mixer.mix_proj.bias.fill_(40.0)          # the window alone
        ids = torch.randint(0, 256, (1, 40))
        torch.testing.assert_close(student(ids), teacher(ids), atol=1e-5, rtol=1e-5)
        st = student.new_state()
        student.prefill(ids[0, :30], st)
        # dynamic RoPE scales by the length each forward sees: compare like with like
        ts = teacher.new_state()
        teacher.prefill(ids[0, :30], ts)
        torch.testing.assert_close(student.decode(ids[0, 30:31], [st]),
                                   teacher.decode(ids[0, 30:31], [ts]), atol=1e-5, rtol=1e-5)

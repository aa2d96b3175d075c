"""Linearised attention with a gated-delta-rule branch (D and K with linear_window): the
layer it builds, prefill/decode equal to training's forward, the engine (chunking,
prefix-cache snapshots, prefill-only hand-over), the state and its arithmetic, checkpoints,
and the start a student takes from its teacher."""

import copy
import dataclasses
import pickle

import pytest
import torch
from layer_checks import (
    check_engine_greedy_matches_model_loop,
    check_prefill_only_hand_over,
    check_prefix_cache_snapshots,
)

from hyla.eval.memory import state_bytes
from hyla.model import HylaLM, SequenceState, preset
from hyla.model.context import Context
from hyla.model.formats.checkpoint import load_checkpoint, save_checkpoint
from hyla.model.mixers import (
    GatedDeltaMixer,
    KDAMixer,
    WindowedDeltaMixer,
    WindowedGLAMixer,
    WindowedKDAMixer,
)
from hyla.train.distill.student import build_student

LETTERS = ["D", "K"]


def _model(layers="DDAD", window=5, sinks=2, seed=0, perturb=True):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(preset("debug"), layers=layers, linear_window=window,
                              window_sinks=sinks)
    model = HylaLM(cfg).eval()
    if perturb:             # new parameters off their identity / constant start
        with torch.no_grad():
            for block in model.blocks:
                m = block.mixer
                if isinstance(m, WindowedDeltaMixer):
                    m.mix_proj.weight.normal_(0, 0.3)
                    m.q_map.add_(torch.randn_like(m.q_map) * 0.5)
                    m.k_map.add_(torch.randn_like(m.k_map) * 0.5)
                    m.gk_proj[1].weight.normal_(0, 0.3)
                    m.b_proj.weight.normal_(0, 0.3)
                    m.b_proj.bias.fill_(0.0)
    return model


@pytest.mark.parametrize("letter,cls,kind", [("D", WindowedDeltaMixer, "gated_delta"),
                                             ("K", WindowedKDAMixer, "kda")])
def test_a_window_builds_the_linearised_form(letter, cls, kind):
    model = _model(letter * 2 + "A")
    plain = {"D": GatedDeltaMixer, "K": KDAMixer}[letter]
    m = model.blocks[0].mixer
    assert type(m) is cls and isinstance(m, plain) and m.kind == kind
    assert type(HylaLM(dataclasses.replace(preset("debug"), layers=letter)).blocks[0].mixer) \
        is plain
    spec = plain.state_spec(model.cfg)
    assert spec.kind == kind and spec.per_token == ()
    assert spec.names == ("state", "window_keys", "window_values", "sink_keys", "sink_values")
    H, D = model.cfg.n_heads, model.cfg.head_dim
    assert spec.fixed[0].shape == (H, 2 * D, D)
    assert plain.token_flops(model.cfg) == cls.token_flops(model.cfg) > 0
    decays = 2 * D if letter == "K" else 1
    assert m.gk_proj[1].out_features == H * decays


@pytest.mark.parametrize("letter", LETTERS)
@pytest.mark.parametrize("window,sinks", [(5, 2), (3, 0)])
def test_forward_equals_prefill_then_decode(letter, window, sinks):
    model = _model(letter * 2 + "A" + letter, window=window, sinks=sinks)
    ids = torch.randint(0, 256, (41,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids[None])[0]
    st = model.new_state()
    # chunks shorter than the sinks, than the window, and longer than both (and than a
    # delta-rule chunk of 16)
    for a, b in [(0, 1), (1, 3), (3, 7), (7, 33)]:
        torch.testing.assert_close(model.prefill(ids[a:b], st), full[a:b], atol=1e-4,
                                   rtol=1e-4)
    other = model.new_state()
    model.prefill(ids[:2], other)
    for t in range(33, 41):
        step = model.decode(ids[t:t + 1].repeat(2), [st, other])     # batched with another
        torch.testing.assert_close(step[0], full[t], atol=1e-4, rtol=1e-4)
    assert st.num_tokens == 41 and other.num_tokens == 10


@pytest.mark.parametrize("letter", LETTERS)
def test_decode_from_the_first_token(letter):
    model = _model(letter + "A")
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids[None])[0]
    st = model.new_state()
    model.prefill(ids[:1], st)
    for t in range(1, 12):                       # sinks, ring and delta state by decode alone
        torch.testing.assert_close(model.decode(ids[t:t + 1], [st])[0], full[t], atol=1e-4,
                                   rtol=1e-4)


def test_packed_documents_are_independent():
    model = _model("DK")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = model(ids, cu_seqlens=torch.tensor([0, 1, 17, 40]))[0]
        for a, b in [(0, 1), (1, 17), (17, 40)]:
            torch.testing.assert_close(packed[a:b], model(ids[:, a:b])[0], atol=1e-5,
                                       rtol=1e-5)


@pytest.mark.parametrize("letter", LETTERS)
def test_trains_and_every_parameter_gets_a_gradient(letter):
    model = _model(letter + "A").train()
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(4))
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1),
                                             ids[:, 1:].flatten())
    loss.backward()
    for name, p in model.blocks[0].named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("cfg", [dict(), dict(max_num_batched_tokens=24, snapshot_interval=16,
                                              max_num_seqs=3)], ids=["plain", "chunked"])
def test_engine_greedy_matches_model_loop(cfg):
    check_engine_greedy_matches_model_loop(_model("DAK"), 5, **cfg)


def test_prefix_cache_snapshots_carry_the_window_and_the_delta_state():
    check_prefix_cache_snapshots(_model("KAD"), 6)


def test_prefill_only_state_ships_and_decodes_like_local():
    check_prefill_only_hand_over(_model("DKA"), 7)


def test_state_is_constant_and_counted_everywhere():
    model = _model("DDKA")
    cfg = model.cfg
    st = model.new_state()
    model.prefill(torch.arange(17), st)
    D, H, kv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    one = H * 2 * D * D * 4 + 2 * (5 + 2) * kv * D * 4
    assert st.bytes_by_kind()["gated_delta"] == 2 * one
    assert st.bytes_by_kind()["kda"] == one
    for n in (17, 8192):
        got = state_bytes(cfg, n, kv_dtype=torch.float32)
        assert got["gated_delta"] == 2 * one and got["kda"] == one
    assert st.nbytes == state_bytes(cfg, 17, kv_dtype=torch.float32)["total"]
    assert SequenceState.unflatten(st.flatten()).nbytes == st.nbytes


def test_checkpoint_round_trip_copy_and_pickle(tmp_path):
    model = _model("DKAD")
    save_checkpoint(model, tmp_path / "ck")
    loaded, _ = load_checkpoint(tmp_path / "ck")
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        want = model(ids)
        for other in (loaded, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert [type(b.mixer) for b in other.blocks] == [type(b.mixer) for b in model.blocks]
            assert torch.equal(other(ids), want)


@pytest.mark.parametrize("letter", LETTERS)
def test_student_takes_the_teachers_projections_and_starts_close(letter):
    torch.manual_seed(0)
    teacher = HylaLM(dataclasses.replace(preset("debug"), layers="AAAA")).eval()
    student = build_student(teacher, letter * 2 + "A" + letter, window=64, sinks=4).eval()
    for i in (0, 1, 3):
        s, t = student.blocks[i].mixer, teacher.blocks[i].mixer
        assert isinstance(s, WindowedDeltaMixer)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.equal(getattr(s, name).weight, getattr(t, name).weight), name
        # new_parameters are exactly what the teacher did not give
        new = {id(p) for p in s.new_parameters()}
        taken = {n for n, p in s.named_parameters() if id(p) not in new}
        assert taken == {f"{n}_proj.weight" for n in "qkvo"}
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        a, b = student(ids), teacher(ids)
    assert ((a - b).norm() / b.norm()) < 0.1


@pytest.mark.parametrize("letter", LETTERS)
def test_branch_starts_as_a_decayed_average_of_values(letter):
    """Identical keys: the delta rule keeps m <- g (1 - beta) m + beta v along them, a
    moving average of the values, whatever their scale (no growth with length)."""
    cfg = dataclasses.replace(preset("debug"), layers=letter, linear_window=4, window_sinks=0)
    layer = HylaLM(cfg).blocks[0].mixer
    layer.reset_new_parameters()                  # as init_from_attention leaves it
    B, T, H, D = 1, 200, cfg.n_heads, cfg.head_dim
    q = torch.ones(B, T, H, D)
    k = torch.ones(B, T, cfg.n_kv_heads, D)
    v = torch.full((B, T, cfg.n_kv_heads, D), 3.0)
    x = torch.zeros(B, T, cfg.d_model)
    with torch.no_grad():
        o = layer._linear(x, q, k, v, Context.train(torch.zeros(B, T, dtype=torch.long)))
    beta = torch.sigmoid(layer.b_proj.bias)                              # 1 / window
    torch.testing.assert_close(beta, torch.full((H,), 0.25))
    assert o.shape == (B, T, H, D) and (o <= 3.0 + 1e-4).all()
    # after many tokens the average holds nearly the whole value (decays are slow)
    assert (o[0, -1] > 0.8 * 3.0).all()


@pytest.mark.parametrize("letter", LETTERS)
def test_calibrate_sets_mix_beta_and_decays_from_the_teacher(letter):
    cfg = dataclasses.replace(preset("debug"), layers=letter, linear_window=4, window_sinks=1)
    layer = HylaLM(cfg).blocks[0].mixer
    T, H, D = 64, cfg.n_heads, cfg.head_dim
    q = torch.zeros(1, T, H, D)                   # uniform attention over the causal prefix
    k = torch.zeros(1, T, cfg.n_kv_heads, D)
    got = layer.calibrate(q, k, torch.arange(T))
    assert set(got) == {"window_share", "far_distance", "beta"}
    torch.testing.assert_close(torch.sigmoid(layer.mix_proj.bias),
                               torch.tensor(got["window_share"]), atol=1e-5, rtol=1e-5)
    dist = torch.tensor(got["far_distance"])
    assert (dist >= 4).all()
    torch.testing.assert_close(torch.sigmoid(layer.b_proj.bias), 1 / dist, atol=1e-5,
                               rtol=1e-4)
    # the decays keep ~4x the far distance (K: the middle of its channels' spread)
    g = torch.nn.functional.logsigmoid(layer.gk_proj[1].bias.double()) / \
        cfg.gate_logit_normalizer
    tau = (-1 / g).view(H, -1)
    mid = tau.log().mean(-1).exp()
    torch.testing.assert_close(mid.float(), 4 * dist, rtol=1e-3, atol=1e-3)


def test_glas_windowed_form_is_unchanged_by_the_shared_base():
    cfg = dataclasses.replace(preset("debug"), layers="G", linear_window=4, window_sinks=2)
    layer = HylaLM(cfg).blocks[0].mixer
    assert type(layer) is WindowedGLAMixer
    names = [n for n, _ in layer.named_parameters()]
    assert names[-5:] == ["gk_proj.0.weight", "gk_proj.1.weight", "gk_proj.1.bias",
                          "mix_proj.weight", "mix_proj.bias"]

"""Mamba-2 (S) and LFM2's short convolution (C) everywhere a layer letter goes: each layer
against a float64 token loop written here, prefill then decode against one forward, packed
documents, training, the engine (chunking, prefix-cache snapshots, prefill-only hand-over),
SequenceState and the memory arithmetic, checkpoints, bad options."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from layer_checks import (
    check_engine_greedy_matches_model_loop,
    check_prefill_only_hand_over,
    check_prefix_cache_snapshots,
)

from hyla.eval.memory import state_bytes
from hyla.model import MIXERS, HylaLM, SequenceState, preset
from hyla.model.context import Context
from hyla.model.formats.checkpoint import load_checkpoint, save_checkpoint
from hyla.model.mixers import Mamba2Mixer, ShortConvMixer

OPTS = {"mamba2": {"head_dim": 16, "state_size": 16, "n_groups": 2, "proj_bias": True,
                   "time_step_limit": (0.001, 5.0)}}


def _model(layers, seed=0, **options):
    torch.manual_seed(seed)
    cfg = dataclasses.replace(preset("debug-ssm"), layers=layers,
                              mixer_options={**OPTS, **options})
    return HylaLM(cfg).eval()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _conv_loop(x, weight, bias):
    """x [T, C] through the causal depthwise conv, token by token (zeros before the start)."""
    T, K = x.shape[0], weight.shape[-1]
    pad = torch.cat([x.new_zeros(K - 1, x.shape[1]), x])
    out = torch.stack([(pad[t:t + K] * weight.T).sum(0) for t in range(T)])
    return out if bias is None else out + bias


def mamba2_loop(layer: Mamba2Mixer, x: torch.Tensor) -> torch.Tensor:
    """The Mamba-2 layer on x [T, d] in float64, one token at a time."""
    o, H, P, N, G = layer.opts, layer.heads, layer.opts.head_dim, layer.opts.state_size, \
        layer.opts.n_groups
    z, xbc, dt = F.linear(x, layer.in_proj.weight, layer.in_proj.bias).split(
        [layer.inner, layer.inner + 2 * layer.bc, H], dim=-1)
    xbc = F.silu(_conv_loop(xbc, layer.conv.weight[:, 0], layer.conv.bias))
    xs, Bm, Cm = xbc.split([layer.inner, layer.bc, layer.bc], dim=-1)
    dt = F.softplus(dt + layer.dt_bias).clamp(*o.time_step_limit)
    A = -layer.A_log.exp()
    S = x.new_zeros(H, P, N)
    ys = []
    for t in range(x.shape[0]):
        xt = xs[t].view(H, P)
        Bt = Bm[t].view(G, N).repeat_interleave(H // G, 0)
        Ct = Cm[t].view(G, N).repeat_interleave(H // G, 0)
        S = S * torch.exp(dt[t] * A)[:, None, None] + dt[t][:, None, None] * xt[..., None] \
            * Bt[:, None]
        ys.append((S @ Ct[..., None])[..., 0] + layer.D[:, None] * xt)
    y = torch.stack(ys).reshape(-1, layer.inner) * F.silu(z)
    g = y.view(-1, G, layer.inner // G)
    g = g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + layer.cfg.norm_eps)
    return F.linear(g.reshape(-1, layer.inner) * layer.norm_weight, layer.out_proj.weight,
                    layer.out_proj.bias)


def short_conv_loop(layer: ShortConvMixer, x: torch.Tensor) -> torch.Tensor:
    b, c, h = F.linear(x, layer.in_proj.weight, layer.in_proj.bias).chunk(3, dim=-1)
    y = c * _conv_loop(b * h, layer.conv.weight[:, 0], layer.conv.bias)
    return F.linear(y, layer.out_proj.weight, layer.out_proj.bias)


def test_registered_with_their_letters():
    assert MIXERS["S"] is Mamba2Mixer and MIXERS["C"] is ShortConvMixer
    model = _model("SCA")
    assert isinstance(model.blocks[0].mixer, Mamba2Mixer)
    assert isinstance(model.blocks[1].mixer, ShortConvMixer)


@pytest.mark.parametrize("letter,loop", [("S", mamba2_loop), ("C", short_conv_loop)])
def test_layer_equals_its_float64_token_loop(letter, loop):
    layer = _model(letter).double().blocks[0].mixer
    with torch.no_grad():   # give every parameter a non-trivial value
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        x = torch.randn(1, 150, 64, dtype=torch.float64)
        got = layer(x, Context.train(torch.zeros(1, 150, dtype=torch.long)))[0]
        assert rel(got, loop(layer, x[0])) < 1e-10


@pytest.mark.parametrize("layers", ["SCA", "CSS"])
def test_forward_equals_prefill_then_decode(layers):
    model = _model(layers).double()      # the states between calls stay float32
    ids = torch.randint(0, 256, (41,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids[None])[0]
    st = model.new_state()
    # chunks shorter than the conv window, then a long one
    for a, b in ((0, 2), (2, 4), (4, 33)):
        assert rel(model.prefill(ids[a:b], st), full[a:b]) < 1e-6
    other = model.new_state()
    model.prefill(ids[:5], other)
    for t in range(33, 41):
        step = model.decode(ids[t:t + 1].repeat(2), [st, other])   # batched with another
        assert rel(step[0], full[t]) < 1e-6
    assert st.num_tokens == 41 and other.num_tokens == 13


def test_packed_documents_are_independent():
    model = _model("SC")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = model(ids, cu_seqlens=torch.tensor([0, 1, 17, 40]))[0]
        for a, b in [(0, 1), (1, 17), (17, 40)]:
            torch.testing.assert_close(packed[a:b], model(ids[:, a:b])[0], atol=1e-5,
                                       rtol=1e-5)


def test_trains_every_parameter_gets_a_gradient():
    model = _model("SCA").train()
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        for name, p in model.blocks[:2].named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("cfg", [dict(), dict(max_num_batched_tokens=24, snapshot_interval=16,
                                              max_num_seqs=3)], ids=["plain", "chunked"])
def test_engine_greedy_matches_model_loop(cfg):
    check_engine_greedy_matches_model_loop(_model("SCA"), 4, **cfg)


def test_prefix_cache_snapshots_carry_the_ssm_state_and_windows():
    check_prefix_cache_snapshots(_model("SCA"), 5)


def test_prefill_only_state_ships_and_decodes_like_local():
    check_prefill_only_hand_over(_model("CSA"), 6)


def test_state_bytes_are_known_without_running_and_constant(tmp_path):
    model = _model("SCSA")
    st = model.new_state()
    model.prefill(torch.randint(0, 256, (30,)), st)
    fixed = 2 * 4 * (8 * 16 * 16 + 3 * (128 + 2 * 2 * 16)) + 4 * 2 * 64   # S, S, C in fp32
    attention = 30 * 2 * 2 * 16 * 4
    assert st.nbytes == fixed + attention == state_bytes(model.cfg, 30, torch.float32)["total"]
    again = SequenceState.unflatten(st.flatten())
    assert again.nbytes == st.nbytes
    save_checkpoint(model, tmp_path / "m")
    back, _ = load_checkpoint(tmp_path / "m")
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


@pytest.mark.parametrize("options,needle", [
    ({"mamba2": {"n_heads": 3, "n_groups": 2}}, "n_heads=3 must be a multiple of n_groups=2"),
    ({"mamba2": {"conv_kernel": 0}}, "conv_kernel must be >= 1"),
    ({"mamba2": {"conv_kernel": 1000000}}, "conv_kernel must be at most 64"),
    ({"mamba2": {"time_step_limit": (1.0, 0.5)}}, "time_step_limit"),
    ({"short_conv": {"kernel": 0}}, r"kernel must be in \[1, 64\]"),
    ({"mamba2": {"state_sise": 8}}, "unknown option"),
])
def test_bad_options_are_named(options, needle):
    with pytest.raises(ValueError, match=needle):
        HylaLM(dataclasses.replace(preset("debug-ssm"), layers="SC", mixer_options=options))

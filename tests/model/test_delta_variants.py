"""The ``D`` / ``K`` mixers with :class:`DeltaOptions` compute what the transformers families'
linear layers compute: Qwen3-Next's and Qwen3.5's GatedDeltaNet (value-head groups, fused
projections), OLMo hybrid's (beta * 2), Kimi Linear's KDA (low-rank gates) and Ring-2.5's
(safe gate). Random weights, every norm / A_log / dt_bias / conv randomised; the hyla layer
gets the same weights, its train forward equals transformers' on a batch of 2, and its
prefill in chunks + batched decode equals its train forward."""

from __future__ import annotations

import pytest
import torch

from hyla.model.config import HylaConfig
from hyla.model.context import Context
from hyla.model.formats.families.qwen3_next.tensors import split_ba, split_qkvz
from hyla.model.mixers.deltanet import GatedDeltaMixer, KDAMixer

transformers = pytest.importorskip("transformers")
from hf_reference import reference  # noqa: E402  (tests/ is on the path)

D = 32
T = 40


def rel(a, b):
    return float((a - b).norm() / b.norm())


def randomise(module):
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "A_log" in name:
                p.copy_(torch.empty_like(p).uniform_(0.05, 2.0).log())
            elif "dt_bias" in name:
                p.normal_(0.0, 1.0)
            elif "conv" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.3)


def hyla_layer(cls, options, n_heads=2, eps=1e-6):
    kind = cls.kind
    cfg = HylaConfig(vocab_size=256, d_model=D, layers=cls.letter, n_heads=n_heads, ffn_dim=64,
                     chunk_size=16, norm_eps=eps, mixer_options={kind: options})
    return cls(cfg).eval()


def load(layer, weights):
    sd = layer.state_dict()
    assert set(weights) == set(sd), (set(weights) ^ set(sd))
    layer.load_state_dict({k: v.reshape(sd[k].shape) for k, v in weights.items()})


def qwen3_next():
    m = reference("qwen3_next")
    cfg = transformers.Qwen3NextConfig(hidden_size=D, linear_num_key_heads=2,
                                       linear_num_value_heads=6, linear_key_head_dim=8,
                                       linear_value_head_dim=4, linear_conv_kernel_dim=3,
                                       rms_norm_eps=1e-5, num_hidden_layers=1,
                                       layer_types=["linear_attention"])
    ref = m.Qwen3NextGatedDeltaNet(cfg, 0)
    randomise(ref)
    opts = dict(num_k_heads=2, num_v_heads=6, head_k_dim=8, head_v_dim=4, conv_kernel=3)
    layer = hyla_layer(GatedDeltaMixer, opts, eps=1e-5)
    sd = ref.state_dict()
    q, k, v, z = split_qkvz(sd["in_proj_qkvz.weight"], 2, 6, 8, 4)
    b, a = split_ba(sd["in_proj_ba.weight"], 2, 6)
    load(layer, {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "g_proj.weight": z,
                 "b_proj.weight": b, "a_proj.weight": a, "conv.weight": sd["conv1d.weight"],
                 "A_log": sd["A_log"], "dt_bias": sd["dt_bias"],
                 "o_norm.weight": sd["norm.weight"], "o_proj.weight": sd["out_proj.weight"]})
    return ref, layer


def qwen3_5():
    m = reference("qwen3_5")
    cfg = transformers.Qwen3_5TextConfig(hidden_size=D, linear_num_key_heads=2,
                                         linear_num_value_heads=4, linear_key_head_dim=8,
                                         linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                         rms_norm_eps=1e-6, num_hidden_layers=1,
                                         layer_types=["linear_attention"])
    ref = m.Qwen3_5GatedDeltaNet(cfg, 0)
    randomise(ref)
    opts = dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6)
    layer = hyla_layer(GatedDeltaMixer, opts)
    sd = ref.state_dict()
    q, k, v = sd["in_proj_qkv.weight"].split([16, 16, 24])
    load(layer, {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v,
                 "g_proj.weight": sd["in_proj_z.weight"], "b_proj.weight": sd["in_proj_b.weight"],
                 "a_proj.weight": sd["in_proj_a.weight"], "conv.weight": sd["conv1d.weight"],
                 "A_log": sd["A_log"], "dt_bias": sd["dt_bias"],
                 "o_norm.weight": sd["norm.weight"], "o_proj.weight": sd["out_proj.weight"]})
    return ref, layer


def olmo_hybrid():
    m = reference("olmo_hybrid")
    cfg = transformers.OlmoHybridConfig(hidden_size=D, linear_num_key_heads=2,
                                        linear_num_value_heads=4, linear_key_head_dim=8,
                                        linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                        linear_allow_neg_eigval=True, rms_norm_eps=1e-6,
                                        num_hidden_layers=2,
                                        layer_types=["linear_attention", "full_attention"])
    ref = m.OlmoHybridGatedDeltaNet(cfg, 0)
    randomise(ref)
    opts = dict(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, beta_scale=2.0,
                o_norm_eps=1e-5)
    layer = hyla_layer(GatedDeltaMixer, opts)
    sd = dict(ref.state_dict())
    sd["conv.weight"] = sd.pop("conv1d.weight")
    load(layer, sd)
    return ref, layer


def kimi_linear():
    m = reference("kimi_linear")
    cfg = transformers.KimiLinearConfig(hidden_size=D, num_hidden_layers=1, rms_norm_eps=1e-5,
                                        linear_attn_config={"head_dim": 8, "num_heads": 4,
                                                            "short_conv_kernel_size": 4})
    ref = m.KimiLinearDeltaAttention(cfg, 0)
    randomise(ref)
    opts = dict(num_k_heads=4, head_k_dim=8, head_v_dim=8, decay_rank=8, gate_rank=8,
                gate_act="sigmoid")
    layer = hyla_layer(KDAMixer, opts, eps=1e-5)
    sd = ref.state_dict()
    load(layer, {**{f"{p}.weight": sd[f"{p}.weight"]
                    for p in ("q_proj", "k_proj", "v_proj", "b_proj", "o_norm", "o_proj")},
                 "conv.weight": sd["conv1d.weight"], "A_log": sd["forget_gate.A_log"],
                 "dt_bias": sd["forget_gate.dt_bias"],
                 "a_down.weight": sd["forget_gate.f_a_proj.weight"],
                 "a_proj.weight": sd["forget_gate.f_b_proj.weight"],
                 "g_down.weight": sd["g_a_proj.weight"], "g_proj.weight": sd["g_b_proj.weight"]})
    return ref, layer


def bailing_hybrid(safe=True):
    m = reference("bailing_hybrid")
    cfg = transformers.BailingHybridConfig(hidden_size=D, num_hidden_layers=1,
                                           num_attention_heads=4, head_dim=8,
                                           short_conv_kernel_size=3, kda_safe_gate=safe,
                                           kda_lower_bound=-3.0, rms_norm_eps=1e-6)
    ref = m.BailingHybridDeltaAttention(cfg, 0)
    randomise(ref)
    opts = dict(num_k_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=3, safe_gate=safe,
                lower_bound=-3.0, gate_act="sigmoid")
    layer = hyla_layer(KDAMixer, opts)
    sd = ref.state_dict()
    load(layer, {**{f"{p}.weight": sd[f"{p}.weight"]
                    for p in ("q_proj", "k_proj", "v_proj", "b_proj", "o_norm", "o_proj",
                              "g_proj")},
                 "conv.weight": sd["conv1d.weight"], "A_log": sd["forget_gate.A_log"],
                 "dt_bias": sd["forget_gate.dt_bias"],
                 "a_proj.weight": sd["forget_gate.f_proj.weight"]})
    return ref, layer


CASES = {"qwen3_next": qwen3_next, "qwen3_5": qwen3_5, "olmo_hybrid": olmo_hybrid,
         "kimi_linear": kimi_linear, "bailing_hybrid": bailing_hybrid,
         "bailing_hybrid-softplus": lambda: bailing_hybrid(safe=False)}


def chunked(layer, x, cuts=((0, 0), (3, 7), (2, 1), (20, 17))):
    """Prefill both sequences of x [2, T, d] together in packed chunks (lengths per step
    from ``cuts``), then decode the rest batched; the outputs [2, T, d]."""
    spec = layer.state_spec(layer.cfg)
    bufs = [{e.name: torch.zeros(2, *e.shape, dtype=e.dtype or x.dtype) for e in spec.fixed}]
    done, outs = [0, 0], [[], []]
    for step in cuts[1:]:
        xs = torch.cat([x[i, done[i]:done[i] + step[i]] for i in range(2)])[None]
        ctx = Context.prefill(done[:], list(step), [0, 1], [[], []], bufs, block_size=16,
                              last_logits=False)
        y = layer(xs, ctx)[0]
        outs[0].append(y[:step[0]])
        outs[1].append(y[step[0]:])
        done = [done[i] + step[i] for i in range(2)]
    assert done[0] == done[1]
    for t in range(done[0], x.shape[1]):
        ctx = Context.decode(torch.tensor([0, 1]), torch.tensor([t, t]),
                             torch.zeros(2, 0, dtype=torch.long), bufs, block_size=16)
        y = layer(x[:, t:t + 1], ctx)
        for i in range(2):
            outs[i].append(y[i])
    return torch.stack([torch.cat(o) for o in outs])


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_transformers(case):
    ref, layer = CASES[case]()
    x = torch.randn(2, T, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = ref(x)
        ours = layer(x, Context.train(torch.zeros(2, T, dtype=torch.long)))
        assert rel(ours, theirs) <= 1e-4, rel(ours, theirs)
        steps = chunked(layer, x)
        assert rel(steps, ours) <= 1e-4, rel(steps, ours)


def test_state_spec_is_the_real_state():
    _, layer = qwen3_next()
    spec = layer.state_spec(layer.cfg)
    assert [e.shape for e in spec.fixed] == [(6, 8, 4), (2, 2 * 16 + 24)]
    _, kda = kimi_linear()
    assert [e.shape for e in kda.state_spec(kda.cfg).fixed] == [(4, 8, 8), (3, 96)]


@pytest.mark.parametrize("options,match", [
    ({"num_k_heads": 4, "num_v_heads": 6}, "multiple of num_k_heads"),
    ({"gate_act": "relu"}, "gate_act"),
    ({"lower_bound": 1.0}, "lower_bound"),
    ({"decay_rnk": 8}, "unknown option"),
])
def test_bad_options_refused(options, match):
    with pytest.raises(ValueError, match=match):
        hyla_layer(GatedDeltaMixer, options)


def test_serving_carries_the_option_shaped_state():
    """A model whose D and K layers have the families' shapes (value-head groups, a 3-tap
    conv, low-rank gates, the safe gate, beta * 2): the engine's greedy tokens equal the
    model's loop, prefix-cache snapshots and a prefill-only hand-over carry its state."""
    from layer_checks import (
        check_engine_greedy_matches_model_loop,
        check_prefill_only_hand_over,
        check_prefix_cache_snapshots,
    )

    from hyla.model import HylaLM

    cfg = HylaConfig(vocab_size=256, d_model=D, layers="DKA", n_heads=2, ffn_dim=64,
                     chunk_size=16, mixer_options={
                         "gated_delta": dict(num_k_heads=2, num_v_heads=4, head_k_dim=8,
                                             head_v_dim=6, conv_kernel=3, beta_scale=2.0),
                         "kda": dict(num_k_heads=4, head_k_dim=8, head_v_dim=8,
                                     decay_rank=8, gate_rank=8, gate_act="sigmoid",
                                     safe_gate=True, lower_bound=-3.0)})
    torch.manual_seed(0)
    model = HylaLM(cfg).eval()
    randomise(model)
    assert [s.fixed[0].shape for s in model.state_specs[:2]] == [(4, 8, 6), (4, 8, 8)]
    check_engine_greedy_matches_model_loop(model, 4, max_num_batched_tokens=24,
                                           snapshot_interval=16, max_num_seqs=3)
    check_prefix_cache_snapshots(model, 5)
    check_prefill_only_hand_over(model, 6)

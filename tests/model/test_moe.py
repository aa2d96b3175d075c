"""The MoE feed-forward against transformers' own MoE blocks (both router kinds), its
grouped-by-expert computation against a dense per-token reference, grouped GEMM against the
per-expert loop, gradients, and the refusals of its options."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.model.ffn import MoEFFN
from hyla.model.formats.families.base import MoENames, moe_from_hyla, moe_to_hyla

D = 32


def moe_cfg(**opts):
    base = {"num_experts": 8, "top_k": 3, "expert_dim": 16}
    return dataclasses.replace(preset("debug"), d_model=D, n_heads=4, n_kv_heads=2,
                               ffn_layers="SEEE", ffn_options={"moe": base | opts})


def dense_reference(moe: MoEFFN, h: torch.Tensor) -> torch.Tensor:
    """Every token through its chosen experts one at a time: what grouping must equal."""
    weights, ids = moe.route(h)
    out = torch.zeros_like(h)
    for n in range(h.shape[0]):
        for w, e in zip(weights[n], ids[n], strict=True):
            g, u = (moe.gate_up[e] @ h[n]).chunk(2)
            out[n] += w * (moe.down[e] @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.parametrize("opts", [
    {"router": "softmax"},
    {"router": "softmax", "norm_topk": True, "shared_dim": 8, "shared_gate": True},
    {"router": "sigmoid", "score_bias": True, "n_group": 4, "topk_group": 2, "norm_topk": True,
     "scaling": 2.5, "shared_dim": 24},
], ids=["softmax", "softmax-norm-gated-shared", "sigmoid-groups-bias"])
def test_grouped_equals_per_token(opts):
    torch.manual_seed(0)
    moe = MoEFFN(moe_cfg(**opts))
    if opts.get("score_bias"):
        moe.score_bias.normal_()
    h = torch.randn(13, D)
    want = dense_reference(moe, h)
    if moe.opts.shared_dim:
        shared = moe.shared(h)
        want = want + (torch.sigmoid(moe.shared_gate(h)) * shared if moe.opts.shared_gate
                       else shared)
    torch.testing.assert_close(moe(h[None])[0], want, rtol=1e-5, atol=1e-6)


def test_group_limited_routing_stays_in_the_best_groups():
    torch.manual_seed(1)
    moe = MoEFFN(moe_cfg(router="sigmoid", n_group=4, topk_group=1, top_k=2))
    _, ids = moe.route(torch.randn(50, D))
    assert (ids[:, 0] // 2 == ids[:, 1] // 2).all()      # both experts from one group of 2


def test_grouped_mm_matches_loop_with_gradients():
    torch.manual_seed(2)
    loop = MoEFFN(moe_cfg(grouped_mm="never"))
    grouped = MoEFFN(moe_cfg(grouped_mm="always"))
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(2, 9, D)
    outs = []
    for m in (loop, grouped):
        y = m(x)
        y.pow(2).sum().backward()
        outs.append((y, m.gate_up.grad, m.down.grad, m.router.weight.grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_model_with_moe_trains_and_counts_active_parameters():
    cfg = moe_cfg(shared_dim=8)
    model = HylaLM(cfg)
    ids = torch.randint(0, 256, (2, 12))
    model(ids).logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    moe = model.blocks[1].mlp
    assert sum(p.numel() for p in moe.parameters()) == MoEFFN.parameters_count(cfg)
    o = moe.opts
    assert MoEFFN.active_parameters(cfg) == D * (o.num_experts + 3 * 3 * 16 + 3 * 8)


@pytest.mark.parametrize("opts, match", [
    ({"top_k": 9}, "top_k=9 exceeds"),
    ({"router": "relu"}, "router must be one of"),
    ({"n_group": 3}, "n_group=3 must divide"),
    ({"n_group": 2, "topk_group": 1}, "needs router='sigmoid'"),
    ({"score_bias": True}, "score_bias needs"),
    ({"shared_gate": True}, "shared_dim must be"),
    ({"topk": 2}, r"unknown option\(s\) \['topk'\]"),
    ({"top_k": 2.5}, "option top_k=2.5 must be"),
])
def test_bad_options_are_refused(opts, match):
    with pytest.raises(ValueError, match=match):
        moe_cfg(**opts)


def test_moe_layer_needs_options():
    want = r"ffn_options\['moe'\]: missing required option\(s\) \['expert_dim', 'num_experts'"
    with pytest.raises(ValueError, match=want):
        dataclasses.replace(preset("debug"), ffn_layers="SSSE")


def _reference_module(name: str):
    pytest.importorskip("transformers")
    from hf_reference import reference

    return reference(name)


def test_softmax_router_equals_qwen3_next_sparse_block():
    ref = _reference_module("qwen3_next")
    import transformers

    hf = transformers.Qwen3NextConfig(hidden_size=D, num_experts=8, num_experts_per_tok=3,
                                      moe_intermediate_size=16, norm_topk_prob=True,
                                      shared_expert_intermediate_size=24)
    torch.manual_seed(3)
    block = ref.Qwen3NextSparseMoeBlock(hf)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    cfg = moe_cfg(top_k=3, norm_topk=True, shared_dim=24, shared_gate=True)
    ours = MoEFFN(cfg)
    sd = {f"m.{k}": v for k, v in block.state_dict().items()}
    names = MoENames(shared="shared_expert")
    state = moe_to_hyla(sd, "m", "x", ours.opts, names, "test")
    ours.load_state_dict({k[2:]: v for k, v in state.items()})
    assert not sd                                   # every tensor found its place
    x = torch.randn(2, 7, D)
    torch.testing.assert_close(ours(x), block(x), rtol=1e-5, atol=1e-6)
    back = moe_from_hyla({f"x.{k}": v for k, v in ours.state_dict().items()}, "x", "m",
                         ours.opts, names)
    assert back["m.experts.5.up_proj.weight"].equal(block.experts.gate_up_proj[5, 16:])


def test_sigmoid_router_equals_kimi_linear_moe():
    ref = _reference_module("kimi_linear")
    import transformers

    hf = transformers.KimiLinearConfig(hidden_size=D, num_experts=8, num_experts_per_tok=3,
                                       moe_intermediate_size=16, n_group=4, topk_group=2,
                                       norm_topk_prob=True, routed_scaling_factor=2.5,
                                       num_shared_experts=2)
    torch.manual_seed(4)
    block = ref.KimiLinearMoE(hf)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    block.gate.e_score_correction_bias.normal_()
    shared = block.shared_experts.gate_proj.out_features
    cfg = moe_cfg(router="sigmoid", score_bias=True, n_group=4, topk_group=2, norm_topk=True,
                  scaling=2.5, shared_dim=shared)
    ours = MoEFFN(cfg)
    sd = {f"m.{k}": v for k, v in block.state_dict().items()}
    state = moe_to_hyla(sd, "m", "x", ours.opts, MoENames(), "test")
    ours.load_state_dict({k[2:]: v for k, v in state.items()})
    assert not sd
    x = torch.randn(2, 7, D)
    torch.testing.assert_close(ours(x), block(x), rtol=1e-5, atol=1e-6)

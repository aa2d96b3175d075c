"""hyla's own MoE presets: their sizes as documented, a few training steps, the per-expert
token counts the balancing reads (once per forward, training mode only), and the option
refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.model.ffn import MoEFFN
from hyla.model.sizing import parameter_counts
from hyla.train.routing import moe_layers, take_counts


@pytest.mark.parametrize("name, total, active, dense", [
    ("debug-moe", 378_064, 193_744, "debug"),
    ("small-moe", 38_967_168, 20_387_712, "small"),
])
def test_presets_have_the_documented_sizes(name, total, active, dense):
    cfg = preset(name)
    n = parameter_counts(cfg)
    assert (n["total"], n["active"], n["moe_layers"]) == (total, active, cfg.n_layers)
    assert cfg.layers == preset(dense).layers and cfg.d_model == preset(dense).d_model
    assert abs(n["active"] / parameter_counts(preset(dense))["active"] - 1) < 0.025
    o = MoEFFN.options(cfg)
    assert (o.num_experts, o.top_k, o.router, o.score_bias, o.balance_rate > 0) == \
        (8, 2, "sigmoid", True, True)
    assert o.shared_dim == o.expert_dim


@pytest.mark.parametrize("layers", ["GGGA", "GDGA"])
def test_debug_moe_trains_and_counts_every_routed_pair(layers):
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("debug-moe"), layers=layers)
    model = HylaLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 256, (1, 48))
    cu = torch.tensor([0, 20, 48])
    losses = []
    for _ in range(4):
        for _ in range(2):        # two micro-batches a step: the counts accumulate
            logits = model(ids, cu_seqlens=cu)
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
            loss.backward()
        opt.step()
        opt.zero_grad()
        counts = take_counts(model)
        assert len(counts) == 4
        assert all(c.sum().item() == 2 * 48 * 2 for c in counts)   # micro x tokens x top_k
        assert all(m.expert_counts is None for m in moe_layers(model))   # reset
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_small_moe_steps():
    torch.manual_seed(0)
    model = HylaLM(dataclasses.replace(preset("small-moe"), vocab_size=512))
    ids = torch.randint(0, 512, (1, 32))
    model(ids).logsumexp(-1).mean().backward()
    assert all(c.sum().item() == 32 * 2 for c in take_counts(model))
    assert all(m.gate_up.grad is not None for m in moe_layers(model))


def test_counts_skip_eval_and_activation_checkpointing_recompute():
    model = HylaLM(preset("debug-moe"))
    ids = torch.randint(0, 256, (1, 16))
    model.eval()
    with torch.no_grad():
        model(ids)
    assert all(m.expert_counts is None for m in moe_layers(model))
    model.train()
    model.activation_checkpointing = True       # every block's forward runs again in backward
    model(ids).sum().backward()
    assert all(c.sum().item() == 16 * 2 for c in take_counts(model))


def test_counts_are_no_parameters_nor_state():
    model = HylaLM(preset("debug-moe"))
    model(torch.randint(0, 256, (1, 8)))
    keys = set(model.state_dict())
    assert not any("expert_counts" in k or "last_routes" in k for k in keys)
    assert sum("score_bias" in k for k in keys) == 4       # the bias is saved and resumed


@pytest.mark.parametrize("opts, match", [
    ({"balance_rate": -1.0, "router": "sigmoid", "score_bias": True}, "balance_rate"),
    ({"balance_rate": 1e-3, "router": "sigmoid"}, "balance_rate"),
], ids=["negative", "no-bias"])
def test_bad_balance_rate(opts, match):
    base = {"num_experts": 4, "top_k": 2, "expert_dim": 8}
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(preset("debug"), ffn_layers="EEEE",
                            ffn_options={"moe": base | opts})

"""Per-layer configuration: FFN letters, per-layer overrides of any field, layer-kind options,
zero-centred norms and post-norm blocks, through construction, state specs, save and load."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest
import torch

from hyla.model import HylaConfig, HylaLM, load_model, preset
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.model.mixers import layer_specs

MOE = {"moe": {"num_experts": 4, "top_k": 2, "expert_dim": 32, "router": "sigmoid",
               "score_bias": True, "n_group": 2, "topk_group": 1}}


def hybrid() -> HylaConfig:
    return dataclasses.replace(
        preset("debug"), layers="GAGA", ffn_layers="SESE", ffn_options=MOE,
        layer_overrides=[{}, {"sliding_window": 5, "n_kv_heads": 4, "rope_theta": 500.0},
                         {"norm_placement": "post", "ffn_dim": 48}, {}],
        norm_zero_centred=True)


def test_overrides_reach_each_layer_and_its_state():
    cfg = hybrid()
    model = HylaLM(cfg)
    specs = layer_specs(cfg)
    assert specs[1].fixed[0].shape == (5, 4, 16) and specs[3].per_token[0].shape == (2, 16)
    assert model.blocks[1].mixer.cfg.sliding_window == 5
    assert model.blocks[3].mixer.cfg.sliding_window is None
    assert model.blocks[2].mlp.gate_proj.out_features == 48
    assert model.blocks[0].mlp.gate_proj.out_features == 128
    assert not model.blocks[2].pre_norm and model.blocks[0].pre_norm
    assert not model.norm.weight.detach().any()         # zero-centred: 1 + 0


def test_save_load_round_trip_keeps_everything():
    torch.manual_seed(0)
    model = HylaLM(hybrid()).eval()
    model.blocks[1].mlp.score_bias.normal_()
    d = save_checkpoint(model, tempfile.mkdtemp())
    loaded, _ = load_model(d)
    assert loaded.cfg == model.cfg
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(),
                              strict=True):
        assert a.equal(b), k
    ids = torch.randint(0, 256, (2, 11))
    assert loaded(ids).equal(model(ids))


def test_prefill_decode_equals_forward_with_overrides():
    torch.manual_seed(1)
    model = HylaLM(hybrid()).eval()
    ids = torch.randint(0, 256, (12,))
    full = model(ids[None])[0]
    state = model.new_state()
    model.prefill(ids[:9], state)
    steps = [model.decode(ids[i:i + 1], [state])[0] for i in range(9, 12)]
    torch.testing.assert_close(torch.stack(steps), full[9:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change, match", [
    ({"ffn_layers": "SES"}, "ffn_layers must be a string of 4"),
    ({"ffn_layers": "SESX"}, r"unknown letter\(s\) \['X'\]"),
    ({"layer_overrides": [{}] * 3}, "layer_overrides must be a list of 4"),
    ({"layer_overrides": [{"d_model": 32}, {}, {}, {}]}, r"\['d_model'\] that cannot differ"),
    ({"layer_overrides": [{"n_kv_heads": 3}, {}, {}, {}]}, "n_kv_heads must divide"),
    ({"mixer_options": {"mamba": {}}}, r"unknown layer kind\(s\) \['mamba'\]"),
    ({"mixer_options": {"gla": {"x": 1}}}, "takes no options|unknown option"),
    ({"norm_placement": "sandwich"}, "norm_placement must be"),
])
def test_bad_layer_fields_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(hybrid(), **change)


@pytest.mark.parametrize("change, match", [
    ({"ffn_layers": "SE", "ffn_options": MOE}, "ffn_layers='SE' has no Llama"),
    ({"layer_overrides": [{}, {"sliding_window": 4}]}, "layer_overrides=.* has no Llama"),
    ({"mixer_options": {"attention": {"output_gate": True}}}, "mixer_options=.* has no Llama"),
    ({"family": "qwen3_next"}, "export it with --format transformers"),
])
def test_llama_export_refuses_what_llama_cannot_hold(change, match):
    from hyla.data import ByteTokenizer
    from hyla.model.formats.hf import export_hf

    cfg = dataclasses.replace(preset("debug"), layers="AA", **change)
    with pytest.raises(ValueError, match=match):
        export_hf(HylaLM(cfg), ByteTokenizer(), tempfile.mkdtemp(), fmt="llama")

"""Ring-2.5 (bailing_hybrid) in and out: KDA layers (bounded and softplus forget gates) and
MLA layers (interleaved RoPE, head-wise output gate, with and without the q LoRA, plain and
yarn RoPE with its softmax-scale correction, sequences past the original length), dense and
MoE layers mixed (top-3 of 8 experts, sigmoid router with an expert bias limited to 1 of 2
groups, 2 shared experts), against transformers' own model."""

from __future__ import annotations

import logging
import pathlib
import tempfile

import pytest
import torch
from mla_kda_checks import (
    SHAPE,
    VOCAB,
    add_mtp_layer,
    check_engine,
    check_export,
    check_generate_matches_transformers,
    check_logits_and_steps,
    check_state_bytes,
    edit_config,
    randomise,
    save,
)

from hyla.data.tokenizer import train_bpe
from hyla.model import load_model

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.9}
CASES = {   # id: config overrides
    "q_proj-safe_gate": dict(q_lora_rank=None, kda_safe_gate=True, kda_lower_bound=-3.0,
                             mlp_layer_types=["dense", "sparse", "sparse", "dense"]),
    "q_lora-yarn-bias-softplus": dict(q_lora_rank=16, attention_bias=True, rope="yarn",
                                      kda_safe_gate=False,
                                      mlp_layer_types=["sparse", "dense", "sparse", "sparse"]),
}


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)


def ring(seed=0, rope=None, **overrides):
    from hf_reference import reference

    mod = reference("bailing_hybrid")
    params = (YARN if rope == "yarn" else {"rope_type": "default"}) | {"rope_theta": 500.0}
    config = transformers.BailingHybridConfig(**(SHAPE | dict(
        head_dim=16, layer_group_size=2, short_conv_kernel_size=3, num_mtp_layers=0,
        rms_norm_eps=1e-6, rope_parameters=params, max_position_embeddings=128) | overrides))
    torch.manual_seed(seed)
    return randomise(mod.BailingHybridForCausalLM(config), seed)


@pytest.mark.parametrize("case", list(CASES))
def test_ring_matches_transformers_and_exports(tmp_path, bpe, case):
    ref = ring(**CASES[case])
    src = save(ref, tmp_path / "ring", bpe)
    model, tok, err, steps = check_logits_and_steps(ref, src)
    assert err <= 1e-4 and steps <= 1e-4, (err, steps)
    assert model.cfg.layers == "KMKM" and model.cfg.family == "bailing_hybrid"
    mla = model.blocks[1].mixer
    assert mla.opts.rope == "interleaved" and mla.opts.output_gate
    assert mla.scale == pytest.approx(ref.model.layers[1].self_attn.scaling)
    check_generate_matches_transformers(model, ref)
    check_export(model, tok, src, tmp_path / "export", transformers, ref)


def test_engine_and_prefix_cache():
    ref = ring(q_lora_rank=16, rope="yarn", mlp_layer_types=["dense", "sparse", "sparse",
                                                             "dense"])
    with tempfile.TemporaryDirectory() as d:
        bpe = train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)
        model, _ = load_model(save(ref, pathlib.Path(d), bpe))
    check_engine(model)
    check_state_bytes(model, ref.config)


def test_hub_config_layout_and_mtp_dropped(tmp_path, bpe, caplog):
    """The released config's names (head_dim the KDA head dim, layer_group_size,
    first_k_dense_replace, no linear_* fields) and an MTP layer after the decoder, left out
    with a note."""
    ref = ring(mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    src = save(ref, tmp_path / "ring", bpe)
    edit_config(src, layer_types=None, mlp_layer_types=None, linear_head_dim=None,
                linear_num_heads=None, linear_conv_kernel_dim=None, head_dim=16,
                first_k_dense_replace=1, layer_group_size=2, short_conv_kernel_size=3,
                rope_parameters=None, rope_theta=500.0, partial_rotary_factor=0.5,
                no_kda_lora=True, gated_attention_proj_granularity_type="head_wise",
                use_qkv_bias=False, rope_interleave=True, score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=32,
                qk_head_dim=20, rotary_dim=8)
    add_mtp_layer(src, 4, "num_nextn_predict_layers")
    with caplog.at_level(logging.INFO):
        model, _ = load_model(src)
    assert "multi-token-prediction" in caplog.text
    assert model.cfg.layers == "KMKM" and model.cfg.ffn_layers == "SEEE"
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        assert torch.allclose(model(ids), ref(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("changes,match", [
    (dict(use_qk_norm=True), "use_qk_norm"),
    (dict(score_function="softmax"), "score_function"),
    (dict(moe_router_enable_expert_bias=False), "moe_router_enable_expert_bias"),
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(partial_rotary_factor=0.5, rope_parameters=YARN | {"rope_theta": 1e4}),
     "partial_rotary_factor"),
    (dict(no_kda_lora=False), "no_kda_lora"),
    (dict(gated_attention_proj_granularity_type="element_wise"),
     "gated_attention_proj_granularity_type"),
    (dict(rotary_dim=4), "rotary_dim"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "longrope"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(moe_shared_expert_intermediate_size=48), "moe_shared_expert_intermediate_size"),
    (dict(mlp_layer_types=["dense", "moe", "dense", "dense"]), "mlp_layer_types"),
    (dict(kda_lower_bound=1.0), "lower_bound"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_refusals(tmp_path, bpe, changes, match):
    src = save(ring(mlp_layer_types=["dense", "sparse", "sparse", "dense"]), tmp_path / "r",
               bpe)
    edit_config(src, **changes)
    with pytest.raises(ValueError, match=match) as err:
        load_model(src)
    assert "config.json" in str(err.value)


def test_export_refuses_what_ring_cannot_hold(tmp_path, bpe):
    import dataclasses

    from hyla.model.formats.hf import export_hf
    from hyla.model.model import HylaLM

    model, tok = load_model(save(ring(), tmp_path / "r", bpe))
    other = HylaLM(dataclasses.replace(model.cfg, layers="KMKA"))
    with pytest.raises(ValueError, match="layers='KMKA'.*bailing_hybrid"):
        export_hf(other, tok, tmp_path / "out", fmt="transformers")

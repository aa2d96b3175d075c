"""Kimi Linear (kimi_linear) in and out: KDA and NoPE MLA layers (with and without the q
LoRA), dense and MoE layers mixed (top-3 of 8 experts, sigmoid router with a correction bias
limited to 1 of 2 groups, 2 shared experts), against transformers' own model."""

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

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
CASES = {   # id: config overrides
    "q_proj": dict(q_lora_rank=None, mlp_layer_types=["dense", "sparse", "sparse", "dense"]),
    "q_lora-bias-tied": dict(q_lora_rank=16, attention_bias=True, tie_word_embeddings=True,
                             mlp_layer_types=["sparse", "dense", "sparse", "sparse"]),
}


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)


def kimi(seed=0, **overrides):
    from hf_reference import reference

    mod = reference("kimi_linear")
    config = transformers.KimiLinearConfig(**(SHAPE | dict(
        layer_types=LAYERS, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=3,
        rms_norm_eps=1e-5, bos_token_id=None) | overrides))
    torch.manual_seed(seed)
    return randomise(mod.KimiLinearForCausalLM(config), seed)


@pytest.mark.parametrize("case", list(CASES))
def test_kimi_linear_matches_transformers_and_exports(tmp_path, bpe, case):
    ref = kimi(**CASES[case])
    src = save(ref, tmp_path / "kimi", bpe)
    model, tok, err, steps = check_logits_and_steps(ref, src)
    assert err <= 1e-4 and steps <= 1e-4, (err, steps)
    assert model.cfg.layers == "KMKM" and model.cfg.family == "kimi_linear"
    assert model.blocks[1].mixer.opts.rope == "none"            # Kimi's MLA is NoPE
    assert tok.encode("def f(x):") == bpe.encode("def f(x):")
    check_generate_matches_transformers(model, ref)
    check_export(model, tok, src, tmp_path / "export", transformers, ref)


def test_engine_and_prefix_cache():
    ref = kimi(q_lora_rank=16, mlp_layer_types=["dense", "sparse", "sparse", "dense"])
    with tempfile.TemporaryDirectory() as d:
        bpe = train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)
        model, _ = load_model(save(ref, pathlib.Path(d), bpe))
    check_engine(model)
    check_state_bytes(model, ref.config)


def test_original_checkpoint_layout_and_mtp_dropped(tmp_path, bpe, caplog):
    """The released config names (linear_attn_config with 1-indexed layer lists,
    first_k_dense_replace) and an MTP layer after the decoder, left out with a note."""
    ref = kimi(mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    src = save(ref, tmp_path / "kimi", bpe)
    edit_config(src, layer_types=None, mlp_layer_types=None, first_k_dense_replace=1,
                linear_head_dim=None, linear_num_heads=None, linear_conv_kernel_dim=None,
                linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3],
                                    "head_dim": 16, "num_heads": 4,
                                    "short_conv_kernel_size": 3},
                mla_use_nope=True, moe_router_activation_func="sigmoid", moe_layer_freq=1)
    add_mtp_layer(src, 4, "num_nextn_predict_layers")
    with caplog.at_level(logging.INFO):
        model, _ = load_model(src)
    assert "multi-token-prediction" in caplog.text
    assert model.cfg.layers == "KMKM" and model.cfg.ffn_layers == "SEEE"
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        assert torch.allclose(model(ids), ref(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("changes,match", [
    (dict(mla_use_nope=False), "mla_use_nope"),
    (dict(mla_use_output_gate=True), "mla_use_output_gate"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(layer_types=["linear_attention", "sliding_attention"] * 2), "layer_types"),
    (dict(linear_attn_config={"use_full_rank_gate": True}), "use_full_rank_gate"),
    (dict(use_grouped_topk=False), "use_grouped_topk"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_refusals(tmp_path, bpe, changes, match):
    src = save(kimi(mlp_layer_types=["dense", "sparse", "sparse", "dense"]), tmp_path / "k", bpe)
    edit_config(src, **changes)
    with pytest.raises(ValueError, match=match) as err:
        load_model(src)
    assert "config.json" in str(err.value)


def test_export_refuses_what_kimi_cannot_hold(tmp_path, bpe):
    import dataclasses

    from hyla.model.formats.hf import export_hf
    from hyla.model.model import HylaLM

    model, tok = load_model(save(kimi(), tmp_path / "k", bpe))
    opts = model.cfg.mixer_options | {"mla": model.cfg.mixer_options["mla"] | {"rope": "half"}}
    other = HylaLM(dataclasses.replace(model.cfg, mixer_options=opts))
    with pytest.raises(ValueError, match="rope='half'.*kimi_linear"):
        export_hf(other, tok, tmp_path / "out", fmt="transformers")

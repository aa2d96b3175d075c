"""Granite 4.0-H in and out: small random ``GraniteMoeHybridForCausalLM`` models (Mamba-2 and
attention layers, dense and MoE FFNs, the muP multipliers, NoPE and rope), every norm, bias,
A_log, D and dt_bias randomised: logits equal to transformers', prefill in chunks then
decode, export read back by both, greedy tokens equal to generate, bad configs named."""

from __future__ import annotations

import shutil

import pytest
import torch
from family_checks import check_export, check_prefill_decode, edit_config, rel
from hf_reference import reference

from hyla.data.tokenizer import train_bpe
from hyla.model import load_model
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB, T = 300, 40


def granite_model(experts: int, rope: bool, seed: int = 0):
    mod = reference("granitemoehybrid")
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, shared_intermediate_size=48,
        layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8,
        mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
        mamba_proj_bias=rope, attention_bias=rope, time_step_limit=(0.001, 4.0),
        embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.2,
        logits_scaling=3.0, position_embedding_type="rope" if rope else "nope",
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-5,
        pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(seed)
    model = mod.GraniteMoeHybridForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("bias", ".D")) and "dt_bias" not in name:
                p.normal_(0.0, 0.5)
            elif name.endswith("dt_bias"):
                p.normal_(-1.0, 0.5)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("router.weight") or name.endswith("router.layer.weight"):
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module", params=[(0, False), (4, True)], ids=["dense-nope", "moe-rope"])
def saved(request, tmp_path_factory):
    bpe = train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)
    path = tmp_path_factory.mktemp("granite")
    ref = granite_model(*request.param)
    ref.save_pretrained(path, safe_serialization=True)
    bpe.save(path / "tokenizer.json")
    return ref, path


def test_logits_prefill_decode_and_export(saved, tmp_path):
    ref, path = saved
    model, tok = load_model(path)
    assert model.cfg.layers == "SASS" and model.cfg.family == "granitemoehybrid"
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids)
    assert rel(got, want) < 1e-5
    check_prefill_decode(model, ids[0], got[0], cuts=(1, 3, 21), tol=1e-5)
    check_export(model, tok, tmp_path / "out", transformers, ref, ids, tol=1e-5)


def test_engine_greedy_equals_transformers_generate(saved):
    ref, path = saved
    model, _ = load_model(path)
    prompt = torch.randint(2, VOCAB, (13,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref.generate(prompt[None], max_new_tokens=8, do_sample=False,
                            eos_token_id=None)[0, 13:].tolist()
    eng = Engine(model, None, EngineConfig(max_model_len=64))
    out = eng.generate([prompt.tolist()], SamplingParams(max_tokens=8, temperature=0,
                                                        ignore_eos=True))
    assert out[0].output_ids == want


@pytest.mark.parametrize("changes,needle", [
    ({"layer_types": ["mamba", "moe", "mamba", "mamba"]}, "layer_types"),
    ({"mamba_d_conv": 0}, "conv_kernel must be >= 1"),
    ({"mamba_d_conv": 1000000}, "conv_kernel must be at most 64"),
    ({"mamba_n_heads": 5}, "mamba_n_heads=5"),
    ({"mamba_n_groups": 3}, "multiple of n_groups=3"),
    ({"logits_scaling": 0}, "logits_scaling=0 must be a positive number"),
    ({"mamba_d_state": 32}, "shape"),     # the tensors no longer fit the state size
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
])
def test_bad_configs_are_named(saved, tmp_path, changes, needle):
    _, path = saved
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    edit_config(bad, **changes)
    with pytest.raises(ValueError, match=needle):
        load_model(bad)

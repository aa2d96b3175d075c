"""Falcon-H1 in and out: small random ``FalconH1ForCausalLM`` models (attention and Mamba-2
side by side in every layer, every muP multiplier away from 1, every norm, bias, A_log, D
and dt_bias randomised): logits equal to transformers', prefill in chunks then decode,
export (multipliers folded) read back by both, greedy tokens equal to generate, the norm
before or after the gate, bad configs named."""

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

VOCAB, T = 304, 40
MULTIPLIERS = {"embedding_multiplier": 3.0, "lm_head_multiplier": 0.5,
               "attention_in_multiplier": 0.7, "attention_out_multiplier": 1.3,
               "key_multiplier": 0.6, "ssm_in_multiplier": 1.4, "ssm_out_multiplier": 0.8,
               "ssm_multipliers": [0.5, 1.5, 0.7, 1.2, 0.9], "mlp_multipliers": [0.8, 1.25]}


def falcon_model(seed: int = 0, **extra):
    mod = reference("falcon_h1")
    config = transformers.FalconH1Config(**({
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 24, "mamba_d_ssm": 96, "mamba_n_heads": 6, "mamba_d_head": 16,
        "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_d_conv": 4,
        "mamba_rms_norm": True, "mamba_norm_before_gate": True,
        "time_step_limit": (0.0, 5.0), "rms_norm_eps": 1e-5, "pad_token_id": 0,
        "eos_token_id": 1, "bos_token_id": None, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}} | MULTIPLIERS
        | extra))
    torch.manual_seed(seed)
    model = mod.FalconH1ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("bias", ".D")):
                p.normal_(0.0, 0.5)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
    return model


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, bpe):
    path = tmp_path_factory.mktemp("falcon")
    ref = falcon_model()
    ref.save_pretrained(path, safe_serialization=True)
    bpe.save(path / "tokenizer.json")
    return ref, path


def test_logits_prefill_decode_and_export(saved, tmp_path):
    ref, path = saved
    model, tok = load_model(path)
    assert model.cfg.layers == "PPP" and model.cfg.embedding_scale == 3.0
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


@pytest.mark.parametrize("extra", [
    {"mamba_norm_before_gate": False, "attention_bias": True, "mamba_proj_bias": True,
     "projectors_bias": True, "tie_word_embeddings": True},
    {"mamba_rms_norm": False, "mamba_conv_bias": False},
])
def test_layer_options(tmp_path, bpe, extra):
    """The norm after the gate (as llama.cpp computes it) or none; biases; a tied head."""
    ref = falcon_model(seed=3, **extra)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    bpe.save(tmp_path / "tokenizer.json")
    model, _ = load_model(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model(ids)
        assert rel(got, ref(ids).logits) < 1e-5
    check_prefill_decode(model, ids[0], got[0], cuts=(5, 17), tol=1e-5)


@pytest.mark.parametrize("changes,needle", [
    ({"ssm_multipliers": [1.0, 2.0]}, "ssm_multipliers"),
    ({"key_multiplier": "big"}, "key_multiplier"),
    ({"mlp_multipliers": [1.0, float("nan")]}, "mlp_multipliers"),
    ({"projectors_bias": True}, "projectors_bias"),
    ({"mamba_d_head": 15}, "mamba_d_head"),
    ({"mamba_d_conv": 0}, "conv_kernel must be >= 1"),
    ({"mamba_d_conv": 1000000}, "conv_kernel must be at most 64"),
    ({"mamba_n_groups": 4}, "multiple of n_groups=4"),
    ({"mamba_d_state": 32}, "shape"),     # the tensors no longer fit the state size
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_attention_heads": 5}, "num_attention_heads|n_heads"),
])
def test_bad_configs_are_named(saved, tmp_path, changes, needle):
    _, path = saved
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    edit_config(bad, **changes)
    with pytest.raises(ValueError, match=needle):
        load_model(bad)

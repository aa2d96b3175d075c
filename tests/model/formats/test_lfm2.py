"""LFM2 in and out: a small random ``Lfm2ForCausalLM`` (gated short convolutions and
attention with per-head q/k norms), every norm and bias randomised: logits equal to
transformers', prefill in chunks then decode, export read back by both, the engine's greedy
tokens equal to transformers' generate, bad configs named."""

from __future__ import annotations

import pytest
import torch
from family_checks import check_export, check_prefill_decode, edit_config, rel
from hf_reference import reference

from hyla.data.tokenizer import train_bpe
from hyla.eval.memory import state_bytes
from hyla.model import load_model
from hyla.model.formats.families.lfm2 import ffn_width
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB, T = 300, 24


def lfm2_model(conv_bias: bool, seed: int = 0):
    mod = reference("lfm2")
    config = transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=144, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, conv_bias=conv_bias,
        block_multiple_of=32, block_ffn_dim_multiplier=1.5, norm_eps=1e-5,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        tie_word_embeddings=not conv_bias, pad_token_id=0, eos_token_id=1, bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    torch.manual_seed(seed)
    model = mod.Lfm2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["tied", "conv-bias"])
def saved(request, tmp_path_factory):
    bpe = train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)
    path = tmp_path_factory.mktemp("lfm2")
    ref = lfm2_model(request.param)
    ref.save_pretrained(path, safe_serialization=True)
    bpe.save(path / "tokenizer.json")
    return ref, path


def test_logits_prefill_decode_and_export(saved, tmp_path):
    ref, path = saved
    model, tok = load_model(path)
    assert model.cfg.layers == "CACA" and model.cfg.family == "lfm2"
    assert model.cfg.ffn_dim == ffn_width(ref.config.to_dict()) == 160
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids)
    assert rel(got, want) < 1e-5
    check_prefill_decode(model, ids[0], got[0], cuts=(1, 2, 13), tol=1e-5)
    check_export(model, tok, tmp_path / "out", transformers, ref, ids, tol=1e-5)
    # a conv layer keeps two rows of d_model; attention 2 x 2 heads x 16 a token
    assert state_bytes(model.cfg, 100, torch.float32)["short_conv"] == 2 * 2 * 64 * 4


def test_engine_greedy_equals_transformers_generate(saved):
    ref, path = saved
    model, _ = load_model(path)
    prompt = torch.randint(2, VOCAB, (11,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref.generate(prompt[None], max_new_tokens=8, do_sample=False,
                            eos_token_id=None)[0, 11:].tolist()
    eng = Engine(model, None, EngineConfig(max_model_len=64))
    out = eng.generate([prompt.tolist()], SamplingParams(max_tokens=8, temperature=0,
                                                        ignore_eos=True))
    assert out[0].output_ids == want


@pytest.mark.parametrize("changes,needle", [
    ({"layer_types": ["conv", "mamba", "conv", "full_attention"]}, "layer_types"),
    ({"conv_L_cache": 0}, r"kernel must be in \[1, 64\]"),
    ({"conv_L_cache": 1000000}, r"kernel must be in \[1, 64\]"),
    ({"num_attention_heads": 5}, "n_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_configs_are_named(saved, tmp_path, changes, needle):
    import shutil

    _, path = saved
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    edit_config(bad, **changes)
    with pytest.raises(ValueError, match=needle):
        load_model(bad)

"""Nemotron-H in and out: small random ``NemotronHForCausalLM`` models (Mamba-2, attention
and squared-ReLU MLP blocks, two mixers in a row, every norm, A_log, D and dt_bias
randomised): logits equal to transformers', prefill in chunks then decode, export read back
by both, greedy tokens equal to generate, NVIDIA's ``backbone.*`` names, bad configs named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from family_checks import check_export, check_prefill_decode, edit_config, rel
from hf_reference import reference
from safetensors.torch import load_file, save_file

from hyla.data.tokenizer import train_bpe
from hyla.model import load_model
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB, T = 304, 40
PATTERN = "M-M*-MM-*"       # MLPs after Mamba and attention; two Mamba blocks in a row


def nemotron_model(pattern: str = PATTERN, seed: int = 0, **extra):
    mod = reference("nemotron_h")
    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        layers_block_type=[kinds[c] for c in pattern], num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, mamba_num_heads=8, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, conv_kernel=4, time_step_min=0.01,
        layer_norm_epsilon=1e-5, pad_token_id=0, eos_token_id=1,
        bos_token_id=None, **extra)
    torch.manual_seed(seed)
    model = mod.NemotronHForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("conv1d.bias", ".D")):
                p.normal_(0.0, 0.5)
            elif name.endswith("dt_bias"):
                p.normal_(-1.0, 1.0)       # some dt below time_step_min: the clamp matters
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    bpe = train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 8)
    path = tmp_path_factory.mktemp("nemotron")
    ref = nemotron_model()
    ref.save_pretrained(path, safe_serialization=True)
    bpe.save(path / "tokenizer.json")
    return ref, path


def test_logits_prefill_decode_and_export(saved, tmp_path):
    ref, path = saved
    model, tok = load_model(path)
    assert model.cfg.layers == "SSASSA" and model.cfg.ffn_layers == "RNRNRN"
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids)
    assert rel(got, want) < 1e-5
    check_prefill_decode(model, ids[0], got[0], cuts=(1, 3, 21), tol=1e-5)
    check_export(model, tok, tmp_path / "out", transformers, ref, ids, tol=1e-5)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["layers_block_type"] == [
        {"M": "mamba", "*": "attention", "-": "mlp"}[c] for c in PATTERN]


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


def test_nvidia_backbone_names_and_pattern_string(saved, tmp_path):
    """NVIDIA's releases: ``backbone.*`` tensors and a ``hybrid_override_pattern``."""
    ref, path = saved
    theirs = tmp_path / "nvidia"
    shutil.copytree(path, theirs)
    weights = load_file(theirs / "model.safetensors")
    save_file({k.replace("model.", "backbone.", 1): v for k, v in weights.items()},
              theirs / "model.safetensors")
    hf = json.loads((theirs / "config.json").read_text())
    hf.pop("layers_block_type", None)
    hf.pop("layer_types", None)
    hf["hybrid_override_pattern"] = PATTERN
    (theirs / "config.json").write_text(json.dumps(hf))
    model, _ = load_model(theirs)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel(model(ids), ref(ids).logits) < 1e-5


@pytest.mark.parametrize("changes,needle", [
    ({"layers_block_type": ["mlp", "mamba", "mlp", "attention", "mlp", "mamba", "mamba",
                            "mlp", "attention"]}, "MLP with no Mamba or attention"),
    ({"layers_block_type": ["mamba", "moe", "mamba", "attention", "mlp", "mamba", "mamba",
                            "mlp", "attention"]}, "MoE blocks"),
    ({"layers_block_type": ["mamba", "ssm"]}, "layers_block_type"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ({"conv_kernel": 0}, "conv_kernel must be >= 1"),
    ({"conv_kernel": 1000000}, "conv_kernel must be at most 64"),
    ({"n_groups": 3}, "multiple of n_groups=3"),
    ({"ssm_state_size": 32}, "shape"),     # the tensors no longer fit the state size
    ({"time_step_min": -1}, "time_step_min"),
])
def test_bad_configs_are_named(saved, tmp_path, changes, needle):
    _, path = saved
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    edit_config(bad, **changes)
    with pytest.raises(ValueError, match=needle):
        load_model(bad)

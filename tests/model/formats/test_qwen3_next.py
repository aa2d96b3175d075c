"""Qwen3-Next and Qwen3.5 (text, and the text part of the multimodal config) in and out:
small random transformers models with value-head groups, GQA, an output-gated partial-rotary
attention, MoE (top-k of several experts, a gated shared expert) mixed with dense layers,
every norm / bias / A_log / dt_bias / gate randomised. hyla's logits equal transformers'
(<= 1e-4 relative), the engine's greedy tokens equal ``generate``, prefill + decode equals
the forward, export reloads bit for bit and transformers reads it with equal logits."""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import check_export, check_prefill_decode, rel, save
from hf_reference import reference

from hyla.data.tokenizer import train_bpe
from hyla.model import load_model
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 300
T = 37          # > the conv window, > one chunk (16)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_conv_kernel_dim=4, rms_norm_eps=1e-5, tie_word_embeddings=False,
              attention_bias=False, max_position_embeddings=64,
              rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                               "partial_rotary_factor": 0.5})
MOE = dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
           shared_expert_intermediate_size=32)
LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention",
          "full_attention"]
CASES = {   # id: (modeling module, class, config class, config)
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                   COMMON | MOE | dict(num_hidden_layers=5, layer_types=LAYERS,
                                       decoder_sparse_step=1, mlp_only_layers=[1, 3],
                                       norm_topk_prob=False, attention_bias=True)),
    "qwen3_next-step2": ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                         COMMON | MOE | dict(num_hidden_layers=4, layer_types=LAYERS[:4],
                                             decoder_sparse_step=2, norm_topk_prob=True,
                                             linear_num_value_heads=2)),
    "qwen3_5_text": ("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
                     COMMON | dict(num_hidden_layers=4, layer_types=LAYERS[:4])),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
                         COMMON | MOE | dict(num_hidden_layers=4, layer_types=LAYERS[:4])),
}


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)


def randomise(model, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):      # the gated norm: w, not 1 + w
                p.uniform_(0.5, 1.5)
            elif "norm" in name:                               # zero-centred: 1 + w
                p.normal_(0.0, 0.3)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.1, 2.0).log())
            elif name.endswith("bias"):                        # dt_bias, attention biases
                p.normal_(0.0, 0.5)
            elif "conv1d" in name or name.endswith(("mlp.gate.weight", "expert_gate.weight")):
                p.normal_(0.0, 0.3)
    return model


def hf_model(case, seed=0):
    module, cls, config_cls, kw = CASES[case]
    config = getattr(transformers, config_cls)(**kw)
    torch.manual_seed(seed)
    return randomise(getattr(reference(module), cls)(config).eval(), seed)


def ids_batch(seed=1):
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_and_round_trips(tmp_path, bpe, case):
    ref = hf_model(case)
    model, tok = load_model(save(ref, tmp_path / case, bpe))
    ids = ids_batch()
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids).logits
    assert rel(ours, theirs) <= 1e-4, rel(ours, theirs)
    assert tok.encode("def f(x):") == bpe.encode("def f(x):")
    check_prefill_decode(model, ids[0], ours[0], cuts=(5, 30))
    check_export(model, tok, tmp_path / "export", transformers, ref, ids)


@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_5_text"])
def test_engine_greedy_equals_transformers_generate(tmp_path, bpe, case):
    ref = hf_model(case, seed=3)
    model, _ = load_model(save(ref, tmp_path / case, bpe))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 21)]
    # attention_mask given: else generate masks the prompt's tokens equal to pad_token_id
    want = [ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=int),
                         max_new_tokens=6, do_sample=False,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    eng = Engine(model, None, EngineConfig(max_model_len=64, max_num_batched_tokens=16,
                                           snapshot_interval=16))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert [s.output_ids for s in eng.generate(prompts, params)] == want
    seqs = eng.generate([prompts[1]], params)        # the prefix cache gives the same
    assert seqs[0].num_cached_tokens == 16 and seqs[0].output_ids == want[1]


@pytest.mark.parametrize("case,outer", [("qwen3_5_text", "qwen3_5"),
                                        ("qwen3_5_moe_text", "qwen3_5_moe")])
def test_nested_multimodal_text_config(tmp_path, bpe, caplog, case, outer):
    """A qwen3_5 / qwen3_5_moe directory: config with text_config (+ vision_config), tensors
    under model.language_model.*, the vision tower left out with a warning."""
    ref = hf_model(case)
    path = save(ref, tmp_path / "mm", bpe)
    text = json.loads((path / "config.json").read_text())
    nested = {"model_type": outer, "architectures": ["ForConditionalGeneration"],
              "text_config": text, "vision_config": {"depth": 1},
              "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(nested))
    from safetensors.torch import load_file, save_file

    w = load_file(path / "model.safetensors")
    w = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
         for k, v in w.items()}
    w["model.visual.patch_embed.weight"] = torch.zeros(2, 2)
    save_file(w, path / "model.safetensors")
    with caplog.at_level("WARNING"):
        model, _ = load_model(path)
    assert "vision tower" in caplog.text
    ids = ids_batch()
    with torch.no_grad():
        assert rel(model(ids), ref(ids).logits) <= 1e-4
    assert model.cfg.family == case


@pytest.mark.parametrize("change,match", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention",
                      "linear_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "num_v_heads"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                          "partial_rotary_factor": 0.3125}}, "partial_rotary_factor"),
    ({"attn_output_gate": False}, "attn_output_gate"),
], ids=["act", "layer-type", "value-heads", "odd-rotary", "no-gate"])
def test_refusals(tmp_path, bpe, change, match):
    path = save(hf_model("qwen3_5_text"), tmp_path / "r", bpe)
    cfg = json.loads((path / "config.json").read_text()) | change
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match) as err:
        load_model(path)
    assert "config.json" in str(err.value)


def test_unexpected_tensor_refused(tmp_path, bpe):
    path = save(hf_model("qwen3_5_text"), tmp_path / "t", bpe)
    from safetensors.torch import load_file, save_file

    w = load_file(path / "model.safetensors")
    w["model.layers.0.linear_attn.conv1d.bias"] = torch.zeros(88)
    save_file(w, path / "model.safetensors")
    with pytest.raises(ValueError, match="conv1d.bias"):
        load_model(path)


def test_released_config_layout(tmp_path, bpe):
    """The layout of Qwen/Qwen3-Next-80B-A3B's config.json (transformers 4.57): no
    layer_types (full_attention_interval), rope_theta and partial_rotary_factor at the top,
    rope_scaling null, use_sliding_window false, mtp fields."""
    kw = {k: v for k, v in CASES["qwen3_next"][3].items() if k != "layer_types"}
    ref = randomise(reference("qwen3_next").Qwen3NextForCausalLM(
        transformers.Qwen3NextConfig(**kw, full_attention_interval=2)).eval())
    path = save(ref, tmp_path / "released", bpe)
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    del cfg["layer_types"]
    cfg |= {"full_attention_interval": 2, "rope_theta": rope["rope_theta"],
            "partial_rotary_factor": rope["partial_rotary_factor"], "rope_scaling": None,
            "use_sliding_window": False, "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False}
    (path / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(path)
    assert model.cfg.layers == "DADAD"
    ids = ids_batch()
    with torch.no_grad():
        assert rel(model(ids), ref(ids).logits) <= 1e-4


@pytest.mark.parametrize("change,match", [
    ({"mixer_options": {"gated_delta": {"beta_scale": 2.0}}}, "gated_delta"),
    ({"norm_zero_centred": False}, "norm_zero_centred"),
    ({"sliding_window": 8}, "sliding_window"),
], ids=["beta-scale", "norm", "window"])
def test_export_refuses_what_the_family_cannot_hold(change, match):
    import dataclasses

    from hyla.model.formats.families import FAMILIES
    from hyla.model.formats.families.qwen3_next.family import to_config

    kw = CASES["qwen3_5_text"][3]
    cfg = to_config({"model_type": "qwen3_5_text", **kw}, "config.json")
    FAMILIES["qwen3_5_text"].from_config(cfg)           # as loaded: fine
    options = {k: {**cfg.mixer_options.get(k, {}), **v}
               for k, v in change.pop("mixer_options", {}).items()}
    bad = dataclasses.replace(cfg, mixer_options={**cfg.mixer_options, **options}, **change)
    with pytest.raises(ValueError, match=match):
        FAMILIES["qwen3_5_text"].from_config(bad)

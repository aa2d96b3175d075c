"""MiMo-V2-Flash in and out: a small random ``MiMoV2FlashForCausalLM`` with window and full
layers mixed (sinks, twice the KV heads and their own rope theta in the window layers), a
value head dim of its own, a value scale, partial rotary, q/k/v biases, and dense and MoE
layers mixed (sigmoid router, score-correction bias, group-limited top-k, scaling); every
norm, bias, sink and router bias randomised. Sequences are longer than the window."""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import check_export, check_prefill_decode, rel
from hf_reference import reference

from hyla.data.tokenizer import train_bpe
from hyla.model import load_model
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB, WINDOW, T = 300, 7, 24



def mimo_model(seed: int = 0, **overrides):
    mod = reference("mimo_v2_flash")
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16,
              sliding_window=WINDOW, attention_value_scale=0.7, attention_bias=True,
              layer_types=["full_attention", "sliding_attention", "sliding_attention",
                           "full_attention"],
              mlp_layer_types=["dense", "sparse", "dense", "sparse"],
              n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_group=4,
              topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5, rms_norm_eps=1e-5,
              tie_word_embeddings=False, rope_parameters={
                  "full_attention": {"rope_type": "default", "rope_theta": 5e4,
                                     "partial_rotary_factor": 0.334},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                        "partial_rotary_factor": 0.5}})
    config = mod.MiMoV2FlashConfig(**(kw | overrides))
    torch.manual_seed(seed)
    model = mod.MiMoV2FlashForCausalLM(config).eval()
    with torch.no_grad():   # everything that could hide behind its init value, randomised
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    bpe = train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)
    path = tmp_path_factory.mktemp("mimo")
    ref = mimo_model()
    ref.save_pretrained(path, safe_serialization=True)
    bpe.save(path / "tokenizer.json")
    return ref, path


def test_logits_prefill_decode_and_export(saved, tmp_path):
    ref, path = saved
    model, tok = load_model(path)
    cfg = model.cfg
    assert cfg.layers == "AAAA" and cfg.ffn_layers == "SESE"
    assert [s.group for s in model.state_specs] == ["full attention", "window", "window",
                                                    "full attention"]
    assert [cfg.layer_config(i).sliding_window for i in range(4)] == [None, 7, 7, None]
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids).logits
    assert rel(ours, theirs) <= 1e-4
    check_prefill_decode(model, ids[1], ours[1], cuts=(9, 17))
    check_export(model, tok, tmp_path / "export", transformers, ref, ids)


def test_engine_greedy_and_prefix_cache_equal_transformers_generate(saved):
    ref, path = saved
    model, _ = load_model(path)
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, VOCAB, (17,), generator=g).tolist()
    prompts = [torch.randint(0, VOCAB, (3,), generator=g).tolist()] + [
        shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (2, 5)]
    want = [ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    eng = Engine(model, None, EngineConfig(max_model_len=64, block_size=4))
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [s.output_ids for s in eng.generate(prompts[:2], greedy)] == want[:2]
    (hit,) = eng.generate(prompts[2:], greedy)      # the shared prefix's blocks are cached
    assert hit.num_cached_tokens == 16 and hit.output_ids == want[2]


@pytest.mark.parametrize("field,value", [
    ("hidden_act", "gelu"), ("n_shared_experts", 1), ("add_full_attention_sink_bias", True),
    ("hybrid_layer_pattern", [0, 0, 0, 0]), ("swa_num_key_value_heads", 1),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4,
                                            "factor": 2.0}}),
])
def test_refusals(saved, tmp_path, field, value):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field) as err:
        load_model(bad)
    assert "config.json" in str(err.value)


def test_mtp_tensors_are_dropped_with_a_note(saved, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    _, path = saved
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.mtp.layers.0.proj.weight"] = torch.zeros(2, 2)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO"):
        load_model(tmp_path)
    assert "multi-token-prediction" in caplog.text


def test_missing_fields_read_as_transformers_reads_them(saved):
    from hyla.model.formats.families.mimo_v2_flash import FAMILY

    _, path = saved
    hf = json.loads((path / "config.json").read_text())
    for key in ("attention_value_scale", "layer_types", "mlp_layer_types"):
        del hf[key]
    hf["num_hidden_layers"], hf["sliding_window_size"] = 7, 4
    theirs = reference("mimo_v2_flash").MiMoV2FlashConfig(**hf)
    cfg = FAMILY.to_config(hf, "config.json")
    slides = [cfg.layer_config(i).sliding_window for i in range(7)]
    assert slides == [theirs.sliding_window if t == "sliding_attention" else None
                      for t in theirs.layer_types] and theirs.sliding_window == 5
    assert cfg.ffn_layers == "".join("E" if m == "sparse" else "S"
                                     for m in theirs.mlp_layer_types)
    assert cfg.mixer_options["attention"]["value_scale"] == theirs.attention_value_scale

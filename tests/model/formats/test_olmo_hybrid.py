"""OLMo hybrid in and out: a small random ``OlmoHybridForCausalLM`` (gated DeltaNet layers
with beta doubled, post-norm attention with whole-projection q/k norms and biases, with
rotary and without: NoPE), every norm, bias, A_log and dt_bias randomised."""

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

VOCAB, T = 300, 24



def olmo_model(rope: bool, seed: int = 0):
    mod = reference("olmo_hybrid")
    config = mod.OlmoHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=24, pad_token_id=0, eos_token_id=1, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0 if rope else None})
    torch.manual_seed(seed)
    model = mod.OlmoHybridForCausalLM(config).eval()
    with torch.no_grad():   # everything that could hide behind its init value, randomised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias") and "dt_bias" not in name:
                p.normal_(0.0, 0.5)
            elif name.endswith("dt_bias"):
                p.normal_(-1.0, 0.5)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["rope", "nope"])
def saved(request, tmp_path_factory):
    bpe = train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)
    path = tmp_path_factory.mktemp("olmo")
    ref = olmo_model(request.param)
    ref.save_pretrained(path, safe_serialization=True)
    bpe.save(path / "tokenizer.json")
    return ref, path


def test_logits_prefill_decode_and_export(saved, tmp_path):
    ref, path = saved
    model, tok = load_model(path)
    cfg = model.cfg
    assert cfg.layers == "DADA" and (ref.model.rotary_emb is not None) == \
        cfg.mixer_options["attention"]["rotary"]
    assert [cfg.layer_config(i).norm_placement for i in range(4)] == ["pre", "post"] * 2
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
    eng = Engine(model, None, EngineConfig(max_model_len=64, block_size=4,
                                           snapshot_interval=8))
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [s.output_ids for s in eng.generate(prompts[:2], greedy)] == want[:2]
    (hit,) = eng.generate(prompts[2:], greedy)      # a snapshot of the shared prefix
    assert hit.num_cached_tokens == 16 and hit.output_ids == want[2]


@pytest.mark.parametrize("field,value", [
    ("hidden_act", "gelu"), ("attention_dropout", 0.1), ("linear_num_value_heads", 4),
    ("layer_types", ["linear_attention", "sliding_attention"] * 2),
])
def test_refusals(saved, tmp_path, field, value):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field) as err:
        load_model(tmp_path)
    assert "config.json" in str(err.value)

"""The transformers families hyla loads, with what makes them differ from plain Llama
randomised so that it matters: attention biases (o included), q/k norms, an explicit head
dim, scaled RoPE (sequences longer than its original length) and sliding windows (sequences
longer than the window). Logits within 1e-4 relative of transformers'; prefill + decode
equal to the full forward; export and read back."""

from __future__ import annotations

import pytest
import torch

from hyla.data.tokenizer import train_bpe
from hyla.model import load_model
from hyla.model.formats.hf import export_hf

transformers = pytest.importorskip("transformers")

VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
             tie_word_embeddings=False, max_position_embeddings=16)
T = 48          # longer than every original rope length (16) and window (7, 11) below

ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 6.0, "low_freq_factor": 1.5,
               "high_freq_factor": 5.0, "original_max_position_embeddings": 12},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 12,
             "beta_fast": 16.0, "beta_slow": 2.0},
}
FAMILIES = {    # id: (model_type, config overrides)
    "llama-bias-llama3": ("llama", {"attention_bias": True, "rope": "llama3"}),
    "llama-linear": ("llama", {"rope": "linear", "tie_word_embeddings": True}),
    "llama-dynamic": ("llama", {"rope": "dynamic"}),
    "llama-yarn": ("llama", {"rope": "yarn"}),
    "mistral-window": ("mistral", {"sliding_window": 7}),
    "qwen2-bias-yarn": ("qwen2", {"rope": "yarn"}),
    "qwen3-norm-head_dim": ("qwen3", {"head_dim": 24, "attention_bias": True}),
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": 11,
                               "max_window_layers": 0, "rope": "linear"}),
}
CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)


def hf_model(kind: str, overrides: dict, seed: int = 0):
    kw = SHAPE | {k: v for k, v in overrides.items() if k != "rope"}
    rope = ROPES.get(overrides.get("rope"), {"rope_type": "default"})
    kw["rope_parameters"] = rope | {"rope_theta": 700.0}
    if kind == "mistral":
        kw.setdefault("sliding_window", None)
    name = CLASSES[kind]
    config = getattr(transformers, f"{name}Config")(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():   # norms, biases and q/k norms far from their init, so they matter
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model


def save(model, path, bpe):
    model.save_pretrained(path, safe_serialization=True)
    bpe.save(path / "tokenizer.json")
    return path


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(tmp_path, bpe, family):
    kind, overrides = FAMILIES[family]
    ref = hf_model(kind, overrides)
    model, tok = load_model(save(ref, tmp_path / family, bpe))
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids).logits
    assert rel_err(ours, theirs) <= 1e-4, family
    assert tok.encode("def f(x):") == bpe.encode("def f(x):")
    if overrides.get("rope") != "dynamic":  # dynamic rescales with the length seen: by design
        state = model.new_state()           # prefill in two chunks, then decode token by token
        steps = [model.prefill(ids[0, :20], state), model.prefill(ids[0, 20:30], state)]
        steps += [model.decode(ids[0, t:t + 1], [state]) for t in range(30, T)]
        assert rel_err(torch.cat(steps), ours[0]) <= 1e-4
    # export writes the family whose features it needs; transformers reads it back the same
    out = export_hf(model, tok, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(back(ids).logits, theirs) <= 1e-4


def test_dynamic_rope_decode_matches_transformers_generate(tmp_path, bpe):
    """Dynamic NTK rescales by the length each forward sees: greedy decoding past the
    original length gives transformers' tokens."""
    ref = hf_model("llama", {"rope": "dynamic"})
    model, _ = load_model(save(ref, tmp_path / "dyn", bpe))
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    want = ref.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 12:]
    from hyla.model import generate

    assert generate(model, prompt[0].tolist(), 20, temperature=0) == want.tolist()


@pytest.mark.parametrize("overrides,match", [
    ({"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
     "mixes full and sliding"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
], ids=["mixed-windows", "partial-rotary"])
def test_refused_configs(tmp_path, bpe, overrides, match):
    import json

    path = save(hf_model("qwen2", {}), tmp_path / "q", bpe)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(overrides)
    cfg.pop("layer_types", None)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match) as err:
        load_model(path)
    assert "config.json" in str(err.value)

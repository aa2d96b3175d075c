"""The ``A`` mixer's options against transformers' own attention modules (Qwen3-Next's output
gate and partial rotary, MiMo-V2-Flash's sinks, value head dim and value scale in window and
full layers, OLMo hybrid's whole-projection q/k norms with and without rotary), and prefill in
chunks + decode == the training forward for each, in the model and in the engine."""

import dataclasses

import pytest
import torch
from hf_reference import reference
from layer_checks import (
    check_engine_greedy_matches_model_loop,
    check_prefill_only_hand_over,
    check_prefix_cache_snapshots,
)

from hyla.model import HylaLM, SequenceState
from hyla.model.config import HylaConfig
from hyla.model.context import Context
from hyla.model.mixers.attention import AttentionMixer

B, T, WINDOW = 2, 13, 5


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _mask(window=None) -> torch.Tensor:
    """transformers' additive mask [1, 1, T, T]: causal, optionally a sliding window."""
    q, k = torch.arange(T)[:, None], torch.arange(T)[None]
    ok = (k <= q) if window is None else (k <= q) & (k > q - window)
    return torch.where(ok, 0.0, torch.finfo(torch.float32).min)[None, None]


def _hyla(cfg: HylaConfig, theirs: torch.nn.Module, names: dict[str, str]) -> AttentionMixer:
    layer = AttentionMixer(cfg)
    sd = theirs.state_dict()
    layer.load_state_dict({ours: sd[t] for ours, t in names.items()}, strict=True)
    return layer


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def _names(*extra: str) -> dict[str, str]:
    base = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight") + extra
    return {n: n for n in base}


def test_qwen3_next_output_gate_and_partial_rotary():
    mod = reference("qwen3_next")
    hf = mod.Qwen3NextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, partial_rotary_factor=0.25, rope_theta=1000.0,
                             num_hidden_layers=1, vocab_size=256)
    hf._attn_implementation = "eager"
    theirs = mod.Qwen3NextAttention(hf, 0).eval()
    _randomise(theirs, 0)
    cfg = HylaConfig(vocab_size=256, d_model=64, layers="A", n_heads=4, n_kv_heads=2,
                     ffn_dim=64, attention_head_dim=16, qk_norm=True, norm_zero_centred=True,
                     rope_theta=1000.0, norm_eps=hf.rms_norm_eps, mixer_options={
                         "attention": {"output_gate": True, "partial_rotary_factor": 0.25}})
    ours = _hyla(cfg, theirs, _names("q_norm.weight", "k_norm.weight"))
    x = torch.randn(B, T, 64)
    pos = torch.arange(T)[None].expand(B, -1)
    cos_sin = mod.Qwen3NextRotaryEmbedding(hf)(x, pos)
    want = theirs(x, cos_sin, _mask())[0]
    got = ours(x, Context.train(torch.zeros(B, T, dtype=torch.long)))
    assert _close(got, want) < 1e-5


def _mimo(window: bool):
    mod = reference("mimo_v2_flash")
    hf = mod.MiMoV2FlashConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
        v_head_dim=16, sliding_window=WINDOW, num_hidden_layers=2, vocab_size=256,
        layer_types=["full_attention", "sliding_attention"], attention_value_scale=0.7,
        attention_bias=True, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e4,
                               "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.334}})
    hf._attn_implementation = "eager"
    return mod, hf, 1 if window else 0


@pytest.mark.parametrize("window", [False, True])
def test_mimo_v2_flash_sinks_value_dim_and_window(window):
    mod, hf, idx = _mimo(window)
    theirs = mod.MiMoV2FlashAttention(hf, idx).eval()
    _randomise(theirs, 1)
    kind = hf.layer_types[idx]
    opts = {"value_head_dim": 16, "value_scale": 0.7, "partial_rotary_factor": 0.334,
            "sinks": window}
    cfg = HylaConfig(vocab_size=256, d_model=64, layers="A", n_heads=4,
                     n_kv_heads=2 if window else 1, ffn_dim=64, attention_head_dim=24,
                     attention_bias=True, rope_theta=hf.rope_parameters[kind]["rope_theta"],
                     sliding_window=WINDOW if window else None,
                     mixer_options={"attention": opts})
    extra = ["q_proj.bias", "k_proj.bias", "v_proj.bias"] + (["sinks"] if window else [])
    ours = _hyla(cfg, theirs, _names(*extra))
    x = torch.randn(B, T, 64)
    pos = torch.arange(T)[None].expand(B, -1)
    cos_sin = mod.MiMoV2FlashRotaryEmbedding(hf)(x, pos, kind)
    want = theirs(x, cos_sin, _mask(WINDOW if window else None))[0]
    got = ours(x, Context.train(torch.zeros(B, T, dtype=torch.long)))
    assert _close(got, want) < 1e-5
    spec = AttentionMixer.state_spec(cfg)
    rows = [(cfg.n_kv_heads, 24), (cfg.n_kv_heads, 16)]
    if window:      # a ring of the window's rows, fixed in size
        assert [e.shape for e in spec.fixed] == [(WINDOW, *r) for r in rows]
    else:
        assert [e.shape for e in spec.per_token] == rows


@pytest.mark.parametrize("rope", [True, False])
def test_olmo_hybrid_whole_projection_norms(rope):
    mod = reference("olmo_hybrid")
    hf = mod.OlmoHybridConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              num_hidden_layers=2, vocab_size=256, attention_bias=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 500.0}
                              if rope else None)
    hf._attn_implementation = "eager"
    theirs = mod.OlmoHybridAttention(hf, 1).eval()
    _randomise(theirs, 2)
    cfg = HylaConfig(vocab_size=256, d_model=64, layers="A", n_heads=4, n_kv_heads=2,
                     ffn_dim=64, qk_norm=True, attention_bias=True, attention_out_bias=True,
                     rope_theta=500.0, norm_eps=hf.rms_norm_eps, mixer_options={
                         "attention": {"qk_norm_scope": "all", "rotary": rope}})
    biases = [f"{p}.bias" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    ours = _hyla(cfg, theirs, _names("q_norm.weight", "k_norm.weight", *biases))
    x = torch.randn(B, T, 64)
    pos = torch.arange(T)[None].expand(B, -1)
    cos_sin = mod.OlmoHybridRotaryEmbedding(hf)(x, pos) if rope else None
    want = theirs(x, cos_sin, _mask())[0]
    got = ours(x, Context.train(torch.zeros(B, T, dtype=torch.long)))
    assert _close(got, want) < 1e-5


VARIANTS = {
    "gate_partial": {"output_gate": True, "partial_rotary_factor": 0.5},
    "sinks_value_dim": {"sinks": True, "value_head_dim": 8, "value_scale": 0.7,
                        "partial_rotary_factor": 0.25},
    "whole_norm_nope": {"qk_norm_scope": "all", "rotary": False},
}


def _model(opts: dict, seed: int) -> HylaLM:
    """Window and full attention layers mixed (MiMo's pattern: the window layers have more
    KV heads, their own rope theta and sinks) around a GLA layer."""
    window = {"sliding_window": WINDOW, "n_kv_heads": 4, "rope_theta": 500.0}
    cfg = HylaConfig(vocab_size=256, d_model=64, layers="AGAA", n_heads=4, n_kv_heads=2,
                     ffn_dim=64, attention_head_dim=16, qk_norm=True, chunk_size=16,
                     mixer_options={"attention": opts},
                     layer_overrides=[{}, {}, window, dict(window, sliding_window=9)])
    torch.manual_seed(seed)
    model = HylaLM(cfg).eval()
    _randomise(model, seed)
    with torch.no_grad():
        model.embed.weight.mul_(3)
    return model


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prefill_in_chunks_and_decode_match_the_forward(name):
    model = _model(VARIANTS[name], 3)
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(4))
    full = model(ids[None])[0]
    state = model.new_state()
    parts = [model.prefill(ids[:3], state), model.prefill(ids[3:11], state),
             model.prefill(ids[11:18], state)]
    parts += [model.decode(ids[i:i + 1], [state]) for i in range(18, 23)]
    assert _close(torch.cat(parts), full) < 1e-5
    assert isinstance(state, SequenceState) and state.num_tokens == 23


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_engine_greedy_and_prefix_cache(name):
    model = _model(VARIANTS[name], 5)
    groups = [spec.group for spec in model.state_specs]
    assert groups == ["full attention", "recurrent", "window", "window"]
    check_engine_greedy_matches_model_loop(model, 6, block_size=4)
    check_prefix_cache_snapshots(model, 7)
    check_prefill_only_hand_over(model, 8)


def test_engine_with_window_layers_only_pages_nothing():
    """Window layers keep rings in their slots: with no full-attention layer the engine
    allocates no KV blocks at all."""
    model = _model(VARIANTS["sinks_value_dim"], 8)
    cfg = dataclasses.replace(model.cfg, layers="GGAA",
                              layer_overrides=[{}, {}] + model.cfg.layer_overrides[2:])
    sliding = HylaLM(cfg).eval()
    _randomise(sliding, 9)
    assert not any(spec.per_token for spec in sliding.state_specs)
    check_engine_greedy_matches_model_loop(sliding, 10, block_size=4)


def test_engine_with_a_model_wide_window_and_one_full_layer():
    """A model-wide window with one full layer (``sliding_window: None`` in its override):
    that layer pages its KV, the others keep rings."""
    model = _model(VARIANTS["gate_partial"], 11)
    overrides = [{"sliding_window": None}, {}, {"n_kv_heads": 4}, {}]
    cfg = dataclasses.replace(model.cfg, sliding_window=WINDOW, layer_overrides=overrides)
    mixed = HylaLM(cfg).eval()
    _randomise(mixed, 12)
    assert [spec.group for spec in mixed.state_specs] == [
        "full attention", "recurrent", "window", "window"]
    check_engine_greedy_matches_model_loop(mixed, 13, block_size=4)

"""The multi-head latent attention layer (M): equal to transformers' Kimi Linear (NoPE) and
Ring-2.5 (interleaved RoPE, head-wise output gate, yarn mscale) attention modules, with and
without the q LoRA; prefill in chunks + decode == the training forward; the engine checks;
a state of exactly the compressed latent a token."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from layer_checks import (
    check_engine_greedy_matches_model_loop,
    check_prefill_only_hand_over,
    check_prefix_cache_snapshots,
)

from hyla.eval.memory import state_bytes
from hyla.model import MIXERS, HylaLM, preset
from hyla.model.context import Context
from hyla.model.formats.checkpoint import load_checkpoint, save_checkpoint
from hyla.model.mixers.mla import MLAMixer

transformers = pytest.importorskip("transformers")

D, H = 64, 4
MLA = dict(kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.9}


def _cfg(layers="GMAM", **mla):
    return dataclasses.replace(preset("debug"), layers=layers, rope_theta=500.0,
                               mixer_options={"mla": MLA | mla})


def _model(layers="GMAM", seed=0, **mla):
    torch.manual_seed(seed)
    model = HylaLM(_cfg(layers, **mla)).eval()
    with torch.no_grad():       # norms away from 1, biases away from 0, so they matter
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.3)
    return model


def _causal(T):
    return torch.full((T, T), float("-inf")).triu(1)[None, None]


def _randomise(module):
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)


def _hf_kw(q_lora):
    return dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=H,
                q_lora_rank=q_lora, attention_bias=False, **MLA)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("q_lora", [None, 16], ids=["q_proj", "q_lora"])
def test_equals_kimi_linear_attention(q_lora):
    from hf_reference import reference

    mod = reference("kimi_linear")
    config = transformers.KimiLinearConfig(num_hidden_layers=2, **_hf_kw(q_lora))
    config._attn_implementation = "eager"
    ref = mod.KimiLinearAttention(config, 0).eval()
    _randomise(ref)
    ours = MLAMixer(_cfg(q_lora_rank=q_lora, rope="none"))
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 19, D)
    with torch.no_grad():
        want = ref(x, attention_mask=_causal(19))[0]
        got = ours(x, Context.train(torch.zeros(2, 19, dtype=torch.long)))
    assert _rel(got, want) <= 1e-5


@pytest.mark.parametrize("q_lora,rope", [(None, None), (16, YARN)], ids=["q_proj", "q_lora-yarn"])
def test_equals_bailing_hybrid_attention(q_lora, rope):
    from hf_reference import reference

    mod = reference("bailing_hybrid")
    params = (rope or {"rope_type": "default"}) | {"rope_theta": 500.0}
    config = transformers.BailingHybridConfig(num_hidden_layers=2, rope_parameters=params,
                                              max_position_embeddings=64,
                                              **(_hf_kw(q_lora) | {"attention_bias": True}))
    config._attn_implementation = "eager"
    ref = mod.BailingHybridAttention(config, 0).eval()
    _randomise(ref)
    scaling = None if rope is None else {k: v for k, v in rope.items()}
    cfg = dataclasses.replace(_cfg(q_lora_rank=q_lora, output_gate=True, bias=True),
                              rope_scaling=scaling)
    ours = MLAMixer(cfg)
    ours.load_state_dict(ref.state_dict())
    T = 40                              # past the yarn original length
    x = torch.randn(2, T, D)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        cos_sin = mod.BailingHybridRotaryEmbedding(config)(x, pos)
        want = ref(x, position_embeddings=cos_sin, attention_mask=_causal(T))[0]
        got = ours(x, Context.train(torch.zeros(2, T, dtype=torch.long)))
    assert _rel(got, want) <= 1e-5
    if rope is not None:
        assert ours.scale == pytest.approx(ref.scaling) and ours.scale != (20 ** -0.5)


@pytest.mark.parametrize("mla", [dict(), dict(q_lora_rank=16, rope="half", output_gate=True),
                                 dict(rope="none", bias=True)],
                         ids=["interleaved", "q_lora-half-gate", "nope-bias"])
def test_prefill_chunks_and_decode_equal_forward(mla):
    model = _model(**mla)
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids[None])[0]
    st, other = model.new_state(), model.new_state()
    steps = [model.prefill(ids[:3], st), model.prefill(ids[3:4], st), model.prefill(ids[4:30], st)]
    model.prefill(ids[:5], other)
    for t in range(30, 37):             # batched with a sequence of another length
        steps.append(model.decode(ids[t:t + 1].repeat(2), [st, other])[:1])
    assert _rel(torch.cat(steps), full) <= 1e-5
    assert st.num_tokens == 37


def test_packed_documents_are_independent():
    model = _model("MM")
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = model(ids, cu_seqlens=torch.tensor([0, 9, 30]))[0]
        for a, b in [(0, 9), (9, 30)]:
            torch.testing.assert_close(packed[a:b], model(ids[:, a:b])[0], atol=1e-5,
                                       rtol=1e-5)


@pytest.mark.parametrize("cfg", [dict(), dict(max_num_batched_tokens=24, snapshot_interval=16,
                                              max_num_seqs=3)], ids=["plain", "chunked"])
def test_engine_greedy_matches_model_loop(cfg):
    check_engine_greedy_matches_model_loop(_model(q_lora_rank=16, output_gate=True), 4, **cfg)


def test_prefix_cache_snapshots():
    check_prefix_cache_snapshots(_model(), 5)


def test_prefill_only_state_ships_and_decodes_like_local():
    check_prefill_only_hand_over(_model(rope="none"), 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_is_the_compressed_latent(dtype):
    model = _model("MM").to(dtype)
    st = model.new_state()
    model.prefill(torch.arange(17), st)
    row = (MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]) * dtype.itemsize
    assert st.bytes_by_kind()["mla"] == 2 * 17 * row
    assert MLAMixer.state_spec(model.cfg).per_token_bytes(dtype) == row
    assert state_bytes(model.cfg, 17, kv_dtype=dtype)["mla"] == 2 * 17 * row
    expanded = H * (MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"] + MLA["v_head_dim"])
    assert row < expanded * dtype.itemsize
    assert MIXERS["M"] is MLAMixer


def test_checkpoint_round_trip_and_refusals(tmp_path):
    model = _model("MG", q_lora_rank=16)
    save_checkpoint(model, tmp_path / "ck")
    loaded, _ = load_checkpoint(tmp_path / "ck")
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    with pytest.raises(ValueError, match="mixer_options\\['mla'\\]"):
        dataclasses.replace(preset("debug"), layers="GM")
    with pytest.raises(ValueError, match="rope must be one of"):
        _cfg(rope="sideways")
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        _cfg(qk_rope_head_dim=3)
    with pytest.raises(ValueError, match="sliding_window"):
        dataclasses.replace(_cfg(), sliding_window=8)


def test_trains_every_parameter_gets_a_gradient():
    model = _model("M", q_lora_rank=16, output_gate=True, bias=True).train()
    ids = torch.randint(0, 256, (2, 17))
    model(ids).logsumexp(-1).mean().backward()
    for name, p in model.blocks[0].mixer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bf16_prefill_then_decode():
    model = _model("GM", q_lora_rank=16).to(torch.bfloat16)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        full = model(ids[None])[0].float()
    st = model.new_state()
    assert st.tensors[1][0].dtype == torch.bfloat16
    steps = [model.prefill(ids[:9], st), model.prefill(ids[9:18], st)]
    steps += [model.decode(ids[t:t + 1], [st]) for t in range(18, 24)]
    torch.testing.assert_close(torch.cat(steps).float(), full, atol=0.05, rtol=0.05)

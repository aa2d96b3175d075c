"""flash-linear-attention GLA directories: a random hybrid fla ``GLAForCausalLM`` loads into
hyla with fla's logits; a hyla hybrid exported with ``--format fla`` reads back bit for bit and
loads in ``transformers`` + ``fla`` with hyla's logits; what hyla cannot represent is refused.

How fla's model runs on a CPU: fla's layers call Triton kernels (GLA, RMSNorm, the gated
norm, rotary, SwiGLU) and flash-attn, none of which run here, and ``TRITON_INTERPRET=1`` does
not help (fla's kernels autotune, and Triton's autotuner needs a GPU driver to time them).
:func:`fla_on_cpu` swaps them, for one test, for fla's own pure-PyTorch references
(``fla.ops.gla.naive.naive_recurrent_gla``, ``rms_norm_ref``, ``rotary_embedding_ref``) and
plain ``torch`` (SDPA for flash-attn, ``silu(a) * b`` for SwiGLU). fla's layer code itself,
which is what the format mapping must agree with (projections, KV-head repeats, the
``logsigmoid / 16`` gates, per-head norm and output gate, rotary layout), runs unchanged.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hyla.data.tokenizer import ByteTokenizer
from hyla.model import HylaLM, preset
from hyla.model.formats.fla import export_fla, fla_config_to_hyla, is_fla_dir, load_fla
from hyla.model.formats.hf.tokenizer import byte_tokenizer_json

transformers = pytest.importorskip("transformers")

VOCAB = 300
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_heads=4, num_hidden_layers=4,
             intermediate_size=96, norm_eps=1e-5, initializer_range=0.1,
             attn={"layers": [1, 3], "num_heads": 4, "num_kv_heads": 2, "rope_theta": 500.0},
             fuse_cross_entropy=False, use_cache=False)


# ---------------------------------------------------------------- fla's model on a CPU

def _flash_attn(q, k, v, causal=True, window_size=(-1, -1), **_):
    T, S = q.shape[1], k.shape[1]
    i, j = torch.arange(T)[:, None] + (S - T), torch.arange(S)[None]
    mask = j <= i if causal else torch.ones(T, S, dtype=torch.bool)
    if window_size[0] >= 0:
        mask &= j >= i - window_size[0]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, enable_gqa=k.shape[2] != q.shape[2])
    return o.transpose(1, 2)


def _gla(q, k, v, gk=None, g=None, initial_state=None, output_final_state=False, **_):
    from fla.ops.gla.naive import naive_recurrent_gla

    return naive_recurrent_gla(q, k, v, gk if gk is not None else g, initial_state,
                               output_final_state)


def _rotary(x, cos, sin, interleaved=False, seqlen_offsets=0, cu_seqlens=None, **_):
    from fla.modules.rotary.ops import rotary_embedding_ref

    assert cu_seqlens is None and isinstance(seqlen_offsets, int)
    rows = slice(seqlen_offsets, seqlen_offsets + x.shape[1])
    return rotary_embedding_ref(x, cos[rows], sin[rows], interleaved).to(x.dtype)


def _rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, **_):
    from fla.modules.norm.layernorm import rms_norm_ref

    if weight is None:
        weight = torch.ones(x.shape[-1], dtype=x.dtype)
    return rms_norm_ref(x, weight, bias, residual, eps, prenorm, upcast=True)


def _gated_norm(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    return _rms_norm(x, self.weight, self.bias, eps=self.eps) * F.silu(g)


@pytest.fixture
def fla_models():
    """flash-linear-attention's models (the dev extra), imported when a test runs rather than
    at collection: fla imports Triton, which tests/ops/test_streamkl_triton.py needs to see
    TRITON_INTERPRET before it is first imported."""
    return pytest.importorskip("fla.models")


@pytest.fixture
def fla_on_cpu(monkeypatch, fla_models):
    """fla's Triton kernels and flash-attn -> fla's PyTorch references (module docstring)."""
    import fla.layers.attn
    import fla.layers.gla
    import fla.modules.mlp
    import fla.modules.norm.fused_norm_gate
    import fla.modules.norm.layernorm
    import fla.modules.rotary.ops
    from fla.modules.activations import ACT2FN

    monkeypatch.setattr(fla.layers.attn, "flash_attn_func", _flash_attn)
    for name in ("chunk_gla", "fused_recurrent_gla", "fused_chunk_gla"):
        monkeypatch.setattr(fla.layers.gla, name, _gla)
    monkeypatch.setattr(fla.modules.rotary.ops, "rotary_embedding", _rotary)
    monkeypatch.setattr(fla.modules.norm.layernorm, "rms_norm", _rms_norm)
    monkeypatch.setattr(fla.modules.norm.fused_norm_gate.FusedRMSNormGated, "forward",
                        _gated_norm)
    monkeypatch.setattr(fla.modules.mlp, "swiglu", lambda a, b: F.silu(a) * b)
    monkeypatch.setattr(fla.modules.mlp, "swiglu_linear",
                        lambda a, b, w, bias: F.linear(F.silu(a) * b, w, bias))
    monkeypatch.setitem(ACT2FN, "swish", F.silu)     # the unfused output gate's activation


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _fla_dir(fla_models, tmp_path, **overrides):
    """A random fla GLAForCausalLM saved with a byte tokenizer; norms and gate biases
    randomised so that a misnamed or transposed tensor shows."""
    torch.manual_seed(0)
    model = fla_models.GLAForCausalLM(fla_models.GLAConfig(**(SHAPE | overrides))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if "norm" in name
                        else torch.randn_like(p))
    path = tmp_path / "fla"
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer_json().save(str(path / "tokenizer.json"))
    return path, model


def _fla_logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


# ---------------------------------------------------------------- fla -> hyla

@pytest.mark.parametrize("overrides", [
    {},
    {"fuse_norm": False, "fuse_swiglu": False},
    {"num_kv_heads": 2, "tie_word_embeddings": True},
    {"elementwise_affine": False, "hidden_ratio": 2, "intermediate_size": None,
     "attn": {"layers": [0, 2], "num_heads": 4, "qkv_bias": True, "window_size": 16}},
], ids=["fused", "unfused", "gla-kv-heads-tied", "no-affine-ratio-bias-window"])
def test_load_matches_fla_logits(tmp_path, fla_models, fla_on_cpu, overrides):
    path, ref = _fla_dir(fla_models, tmp_path, **overrides)
    assert is_fla_dir(path)
    model, tok = load_fla(path)
    attn = (overrides.get("attn") or SHAPE["attn"])
    assert model.cfg.layers == "".join("A" if i in attn["layers"] else "G" for i in range(4))
    assert model.cfg.tie_embeddings == bool(overrides.get("tie_word_embeddings"))
    assert model.cfg.attention_bias == attn.get("qkv_bias", False)
    assert model.cfg.sliding_window == attn.get("window_size")
    ids = torch.randint(0, VOCAB, (2, 70))   # > 64 tokens: fla's chunk mode, not its short path
    with torch.no_grad():
        ours = model(ids)
    assert _rel(ours, _fla_logits(ref, ids)) <= 1e-4
    assert isinstance(tok, ByteTokenizer)


def test_load_model_dispatches_to_fla(tmp_path, fla_models, fla_on_cpu):
    from hyla.model.load import load_model

    path, ref = _fla_dir(fla_models, tmp_path)
    model, _ = load_model(path)
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        assert _rel(model(ids), _fla_logits(ref, ids)) <= 1e-4


# ---------------------------------------------------------------- hyla -> fla

def _hybrid(**overrides) -> HylaLM:
    cfg = dataclasses.replace(preset("debug"), **({"layers": "GAGGA"} | overrides),
                              vocab_size=VOCAB, rope_theta=500.0, norm_eps=1e-5, chunk_size=64)
    torch.manual_seed(1)
    model = HylaLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if "norm" in name
                        else torch.randn_like(p))
    return model


@pytest.mark.parametrize("overrides", [
    {}, {"tie_embeddings": True, "attention_bias": True, "sliding_window": 16},
], ids=["untied", "tied-bias-window"])
def test_export_reads_back_and_loads_in_transformers(tmp_path, fla_on_cpu, overrides):
    model = _hybrid(**overrides)
    out = export_fla(model, ByteTokenizer(), tmp_path / "export")
    ids = torch.randint(0, VOCAB, (2, 70))
    with torch.no_grad():
        want = model(ids)
        back, tok = load_fla(out)
        assert back.cfg == model.cfg
        torch.testing.assert_close(back(ids), want, atol=0, rtol=0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(ref).__name__ == "GLAForCausalLM"
    assert _rel(_fla_logits(ref, ids), want) <= 1e-4
    assert isinstance(tok, ByteTokenizer)


def test_greedy_tokens_equal_fla_cached_decoding(tmp_path, fla_on_cpu):
    """hyla's generate (prefill, then one-token decode steps) and fla's own cache (GLA state,
    attention KV) pick the same tokens. fla's cache is driven by hand: transformers 5's
    generate() hands it over as ``cache=``, which fla 0.6's forward does not read, so its
    generate() decodes each token without the past."""
    from hyla.model.generate import generate

    model = _hybrid(sliding_window=16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        export_fla(model, ByteTokenizer(), tmp_path / "export"), dtype=torch.float32).eval()
    prompt = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        out = ref(prompt, use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(15):
            out = ref(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                      use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    assert generate(model, prompt[0].tolist(), 16, temperature=0) == tokens


def test_cli_export_format_fla(tmp_path):
    from hyla.cli.main import main
    from hyla.model.formats.checkpoint import save_checkpoint

    model = HylaLM(dataclasses.replace(preset("debug"), layers="GAGGA", chunk_size=64)).eval()
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    assert main(["export", "--format", "fla", str(ckpt), str(tmp_path / "out")]) == 0
    back, _ = load_fla(tmp_path / "out")
    ids = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), atol=0, rtol=0)


# ---------------------------------------------------------------- refusals

GOOD = {"model_type": "gla", "vocab_size": VOCAB, "hidden_size": 64, "num_heads": 4,
        "num_hidden_layers": 4, "attn": {"layers": [1], "num_heads": 4}}


@pytest.mark.parametrize("change, field", [
    ({"feature_map": "relu"}, "feature_map"),
    ({"use_short_conv": True}, "use_short_conv"),
    ({"use_output_gate": False}, "use_output_gate"),
    ({"clamp_min": -3.0}, "clamp_min"),
    ({"hidden_act": "powlu"}, "hidden_act"),
    ({"attnres_block_size": 2}, "attnres_block_size"),
    ({"use_gv": True}, "use_gv"),
    ({"gate_logit_normalizer": 8}, "gate_logit_normalizer"),
    ({"attn": [{"layers": [1], "num_heads": 4, "window_size": 8},
               {"layers": [2], "num_heads": 4}]}, "window_size"),
    ({"attn": {"layers": [1], "num_heads": 2}}, "attn.num_heads"),
    ({"attn": {"layers": [1], "num_heads": 4, "qk_norm": True}}, "qk_norm"),
    ({"attn": [{"layers": [1], "num_heads": 4, "rope_theta": 1e4},
               {"layers": [2], "num_heads": 4, "rope_theta": 5e5}]}, "rope_theta"),
    ({"model_type": "llama"}, "model_type"),
    ({"expand_k": 0.3}, "expand_k"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_refuses_config(change, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as e:
        fla_config_to_hyla(GOOD | change, "/x/config.json")
    assert "/x/config.json" in str(e.value)


def test_refuses_weights(tmp_path, fla_models, fla_on_cpu):
    from safetensors.torch import load_file, save_file

    path, _ = _fla_dir(fla_models, tmp_path)
    weights = load_file(path / "model.safetensors")
    extra = weights | {"model.layers.0.attn.q_conv1d.weight": torch.zeros(4)}
    save_file(extra, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="tensors hyla does not map.*q_conv1d"):
        load_fla(path)
    weights["model.layers.0.attn.gk_proj.0.weight"] = torch.zeros(8, 64)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"gk_proj\.0\.weight has shape \(8, 64\).*\(16, 64\)"):
        load_fla(path)
    del weights["model.layers.0.attn.gk_proj.0.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.0\.attn\.gk_proj\.0"):
        load_fla(path)


@pytest.mark.parametrize("change, message", [
    ({"gate_logit_normalizer": 8.0}, "gate_logit_normalizer=8.0"),
    ({"gate_low_rank_dim": 8}, "gate_low_rank_dim=8"),
    ({"attention_out_bias": True}, "attention_out_bias=True"),
    ({"qk_norm": True}, "qk_norm=True"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"attention_head_dim": 8}, "attention_head_dim=8"),
    ({"layers": "GDA"}, r"layer kind\(s\) \['D'\]"),
])
def test_export_refuses_what_fla_cannot_hold(tmp_path, change, message):
    model = HylaLM(dataclasses.replace(preset("debug"), **change))
    with pytest.raises(ValueError, match=message):
        export_fla(model, ByteTokenizer(), tmp_path / "out")
    assert not (tmp_path / "out").exists()

"""TII Falcon-H1 (``falcon_h1``): every layer runs attention and Mamba-2 side by side.

What maps onto hyla, read from transformers' ``modeling_falcon_h1.py``:

- each decoder layer is ``x + attn(norm(x)) + mamba(norm(x))`` then ``x + mlp(norm(x))``:
  the ``P`` mixer (:mod:`hyla.model.mixers.parallel`, its halves ``mixer.attn`` and
  ``mixer.ssm``) and the ``S`` (SwiGLU) FFN;
- the Mamba-2 half is Granite's layer with Falcon's options: ``mamba_d_ssm`` inner channels,
  the gated norm optional (``mamba_rms_norm``) and applied before or after the gate
  (``mamba_norm_before_gate``);
- the muP multipliers: ``embedding_multiplier`` and ``lm_head_multiplier`` become
  :class:`~hyla.model.HylaConfig`'s ``embedding_scale`` and ``logit_scale``; the others
  (``attention_in``/``out``, ``key``, ``ssm_in``/``out``, the five ``ssm_multipliers`` of
  the in-projection's z, x, B, C and dt rows, ``mlp_multipliers`` of gate and down) are
  folded into the weights they scale, as llama.cpp's converter folds them. An export then
  writes them as 1.

Example:
    >>> from hyla.model.formats.families import FAMILIES
    >>> FAMILIES["falcon_h1"].architecture
    'FalconH1ForCausalLM'
"""

from __future__ import annotations

import math

import torch

from hyla.model.config import HylaConfig
from hyla.model.formats.families.base import (
    Family,
    GgufMapping,
    check_all_taken,
    gguf_shape,
    gguf_value,
    head_from_hyla,
    head_to_hyla,
    mamba2_gguf_tensor,
    refuse,
    register_family,
    require,
    take,
    time_step_limit,
)
from hyla.model.layers import rope_from_hf_config
from hyla.model.mixers import MIXERS

KIND = "falcon_h1"
_REFUSED = {"hidden_act": lambda v: v in ("silu", "swish"),
            "attention_dropout": lambda v: not v, "mlp_bias": lambda v: not v}
_SCALARS = ("attention_in_multiplier", "attention_out_multiplier", "key_multiplier",
            "ssm_in_multiplier", "ssm_out_multiplier", "embedding_multiplier",
            "lm_head_multiplier")
_LISTS = {"ssm_multipliers": 5, "mlp_multipliers": 2}


def _number(value, name: str, source: str) -> float:
    if not (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value)):
        raise ValueError(f"{source}: {name}={value!r} must be a finite number")
    return float(value)


def multipliers(hf: dict, source: str) -> dict:
    """Falcon-H1's muP multipliers (1 where absent), each checked to be a finite number."""
    out = {k: _number(1.0 if hf.get(k) is None else hf[k], k, source) for k in _SCALARS}
    for key, n in _LISTS.items():
        values = hf.get(key) or [1.0] * n
        if not isinstance(values, list | tuple) or len(values) != n:
            raise ValueError(f"{source}: {key}={values!r} must be a list of {n} numbers")
        out[key] = [_number(v, key, source) for v in values]
    return out


def _mamba(hf: dict, d: int, source: str) -> dict:
    heads = int(require(hf, "mamba_n_heads", source, KIND))
    inner = hf.get("mamba_d_ssm") or int(hf.get("mamba_expand", 2)) * d
    head_dim = hf.get("mamba_d_head", "auto")
    if heads < 1:
        raise ValueError(f"{source}: mamba_n_heads={heads} must be >= 1")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if heads * head_dim != inner:
        raise ValueError(f"{source}: mamba_n_heads={heads} x mamba_d_head={head_dim} must be "
                         f"the SSM width (mamba_d_ssm) {inner}")
    bias = bool(hf.get("mamba_proj_bias", False))
    if bool(hf.get("projectors_bias", False)) != bias:
        raise ValueError(f"{source}: projectors_bias={hf.get('projectors_bias')!r} differs "
                         f"from mamba_proj_bias={bias}: hyla's Mamba-2 layer has biases on "
                         f"both projections or on neither")
    return {"n_heads": heads, "head_dim": head_dim,
            "state_size": int(hf.get("mamba_d_state", 256)),
            "n_groups": int(hf.get("mamba_n_groups", 1)),
            "conv_kernel": int(hf.get("mamba_d_conv", 4)),
            "conv_bias": bool(hf.get("mamba_conv_bias", True)), "proj_bias": bias,
            "time_step_limit": time_step_limit(hf), "gated_norm": bool(hf.get("mamba_rms_norm")),
            "norm_before_gate": bool(hf.get("mamba_norm_before_gate", True))}


def to_config(hf: dict, source: str) -> HylaConfig:
    refuse(hf, source, _REFUSED)
    m = multipliers(hf, source)             # refused here, before any tensor is read
    n = int(require(hf, "num_hidden_layers", source, KIND))
    d = int(require(hf, "hidden_size", source, KIND))
    heads = int(require(hf, "num_attention_heads", source, KIND))
    theta, scaling = rope_from_hf_config(hf, source)
    bias = bool(hf.get("attention_bias", False))
    try:
        return HylaConfig(
            vocab_size=int(require(hf, "vocab_size", source, KIND)), d_model=d,
            layers="P" * n, n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            attention_head_dim=int(hf.get("head_dim") or d // heads),
            ffn_dim=int(require(hf, "intermediate_size", source, KIND)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta,
            rope_scaling=scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            attention_bias=bias, attention_out_bias=bias,
            mixer_options={"mamba2": _mamba(hf, d, source)},
            embedding_scale=m["embedding_multiplier"], logit_scale=m["lm_head_multiplier"],
            family=KIND)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def fold(weights: dict, hf: dict, source: str) -> dict:
    """The checkpoint's tensors with the layers' multipliers folded in (out of place)."""
    m = multipliers(hf, source)
    opts = _mamba(hf, int(hf["hidden_size"]), source)
    inner, bc = opts["n_heads"] * opts["head_dim"], opts["n_groups"] * opts["state_size"]
    z, x, b, c, dt = m["ssm_multipliers"]
    rows = torch.cat([torch.full((inner,), z), torch.full((inner,), x), torch.full((bc,), b),
                      torch.full((bc,), c), torch.full((opts["n_heads"],), dt)])
    attn_in, key = m["attention_in_multiplier"], m["key_multiplier"]
    gate, down = m["mlp_multipliers"]
    # (weight scale, bias scale) by the name's end
    scales = {"self_attn.q_proj": (attn_in, 1.0), "self_attn.v_proj": (attn_in, 1.0),
              "self_attn.k_proj": (attn_in * key, key),
              "self_attn.o_proj": (m["attention_out_multiplier"],) * 2,
              "mamba.in_proj": (rows[:, None] * m["ssm_in_multiplier"], rows),
              "mamba.out_proj": (m["ssm_out_multiplier"],) * 2,
              "feed_forward.gate_proj": (gate, gate), "feed_forward.down_proj": (down, down)}
    out = dict(weights)
    for name, w in weights.items():
        base, _, suffix = name.rpartition(".")
        part = base.split(".", 3)[-1] if base.startswith("model.layers.") else None
        if part == "mamba.in_proj" and w.shape[0] != len(rows):
            raise ValueError(f"{source}: {name} has {w.shape[0]} rows, but the config's "
                             f"mamba_d_ssm, mamba_n_groups x mamba_d_state and mamba_n_heads "
                             f"give {len(rows)}: its shape does not fit")
        if part in scales:
            s = scales[part][0 if suffix == "weight" else 1]
            out[name] = w * (s.to(w.dtype) if isinstance(s, torch.Tensor) else s)
    return out


def _names(cfg: HylaConfig, i: int) -> dict[str, str]:
    """hyla block suffix -> transformers decoder-layer suffix."""
    opts = MIXERS["S"].options(cfg.layer_config(i))
    names = {"mixer_norm.weight": "input_layernorm.weight",
             "mlp_norm.weight": "pre_ff_layernorm.weight",
             "mixer.ssm.conv.weight": "mamba.conv1d.weight",
             "mixer.ssm.in_proj.weight": "mamba.in_proj.weight",
             "mixer.ssm.out_proj.weight": "mamba.out_proj.weight"}
    names |= {f"mixer.ssm.{p}": f"mamba.{p}" for p in ("A_log", "D", "dt_bias")}
    names |= {f"mlp.{p}.weight": f"feed_forward.{p}.weight"
              for p in ("gate_proj", "up_proj", "down_proj")}
    if opts.gated_norm:
        names["mixer.ssm.norm_weight"] = "mamba.norm.weight"
    if opts.conv_bias:
        names["mixer.ssm.conv.bias"] = "mamba.conv1d.bias"
    if opts.proj_bias:
        names |= {"mixer.ssm.in_proj.bias": "mamba.in_proj.bias",
                  "mixer.ssm.out_proj.bias": "mamba.out_proj.bias"}
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"mixer.attn.{p}.weight"] = f"self_attn.{p}.weight"
        if cfg.attention_bias:
            names[f"mixer.attn.{p}.bias"] = f"self_attn.{p}.bias"
    return names


def to_state(weights: dict, cfg: HylaConfig, source: str) -> dict:
    weights = dict(weights)
    if "model.final_layernorm.weight" in weights:
        weights["model.norm.weight"] = weights.pop("model.final_layernorm.weight")
    out = head_to_hyla(weights, cfg, source)
    for i in range(cfg.n_layers):
        for ours, theirs in _names(cfg, i).items():
            out[f"blocks.{i}.{ours}"] = take(weights, f"model.layers.{i}.{theirs}", source)
    check_all_taken(weights, source)
    return out


def from_state(state: dict, cfg: HylaConfig) -> dict:
    out = head_from_hyla(state, cfg)
    out["model.final_layernorm.weight"] = out.pop("model.norm.weight")
    for i in range(cfg.n_layers):
        for ours, theirs in _names(cfg, i).items():
            out[f"model.layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
    return out


def from_config(cfg: HylaConfig) -> dict:
    """Falcon-H1's config.json (its layer multipliers 1: hyla's weights hold them);
    ValueError naming what ``cfg`` has that it cannot hold."""
    if set(cfg.layers) != {"P"} or set(cfg.ffn_layers or "S") != {"S"} or cfg.layer_overrides:
        raise ValueError(f"{KIND} export needs 'P' layers with 'S' FFNs of one shape each, "
                         f"got layers {cfg.layers!r}, FFNs {cfg.ffn_layers!r}")
    m = MIXERS["S"].options(cfg)
    att = MIXERS["A"].options(cfg)
    if not att.rotary or att.output_gate or att.sinks or att.softmax_scale or cfg.qk_norm \
            or cfg.sliding_window is not None or att.partial_rotary_factor != 1 \
            or m.norm_eps not in (None, cfg.norm_eps) or cfg.residual_scale != 1 \
            or cfg.attention_bias != cfg.attention_out_bias:
        raise ValueError(f"{KIND} export: a layer option Falcon-H1 does not have (gates, "
                         f"sinks, scales, a window, NoPE or partial rotary)")
    ssm = MIXERS["S"](cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    return {"architectures": ["FalconH1ForCausalLM"], "model_type": KIND,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": rope, "attention_bias": cfg.attention_bias,
            "attention_dropout": 0.0, "mlp_bias": False,
            "mamba_d_ssm": ssm.inner, "mamba_n_heads": ssm.heads, "mamba_d_head": m.head_dim,
            "mamba_n_groups": m.n_groups, "mamba_d_state": m.state_size,
            "mamba_d_conv": m.conv_kernel, "mamba_expand": 2,
            "mamba_conv_bias": m.conv_bias, "mamba_proj_bias": m.proj_bias,
            "projectors_bias": m.proj_bias, "mamba_rms_norm": m.gated_norm,
            "mamba_norm_before_gate": m.norm_before_gate,
            "time_step_limit": list(m.time_step_limit),
            "embedding_multiplier": cfg.embedding_scale,
            "lm_head_multiplier": cfg.logit_scale,
            **{k: 1.0 for k in _SCALARS if k not in ("embedding_multiplier",
                                                     "lm_head_multiplier")},
            **{k: [1.0] * n for k, n in _LISTS.items()},
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.initializer_range, "use_cache": True,
            "max_position_embeddings": 131072, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "torch_dtype": "float32", "dtype": "float32"}


# GGUF block tensor -> transformers decoder-layer suffix (llama.cpp's falcon-h1 names)
_GGUF_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "pre_ff_layernorm",
               "ffn_pre_norm": "pre_ff_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ssm_in": "mamba.in_proj",
               "ssm_out": "mamba.out_proj", "ssm_conv1d": "mamba.conv1d",
               "ssm_norm": "mamba.norm", "ssm_d": "mamba.D", "ssm_a": "mamba.A_log",
               "ssm_dt": "mamba.dt_bias", "ffn_gate": "feed_forward.gate_proj",
               "ffn_up": "feed_forward.up_proj", "ffn_down": "feed_forward.down_proj"}


def gguf_config(meta: dict, shapes: dict, source: str) -> dict:
    """Falcon-H1's config.json from llama.cpp's ``falcon-h1.*`` metadata. The converter has
    folded every multiplier into the weights, and llama.cpp normalises after the gate
    (``mamba_norm_before_gate`` false) and does not clamp the time step: so does this."""
    arch = meta["general.architecture"]

    def get(key, default=None):
        return gguf_value(meta, arch, key, source, default)
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    if heads < 1 or inner % heads:
        raise ValueError(f"{source}: {arch}.ssm.inner_size={inner} must be a multiple of "
                         f"{arch}.ssm.time_step_rank (the SSM heads)={heads}")
    d = int(get("embedding_length"))
    return {"model_type": KIND,
            "vocab_size": gguf_shape(shapes, "token_embd.weight", source)[0],
            "hidden_size": d, "num_hidden_layers": int(get("block_count")),
            "intermediate_size": int(get("feed_forward_length")),
            "num_attention_heads": int(get("attention.head_count")),
            "num_key_value_heads": int(get("attention.head_count_kv")),
            "head_dim": get("attention.key_length", None) or None,
            "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
            "rope_theta": get("rope.freq_base", 10000.0),
            "mamba_d_ssm": inner, "mamba_n_heads": heads, "mamba_d_head": inner // heads,
            "mamba_d_state": get("ssm.state_size"), "mamba_n_groups": get("ssm.group_count"),
            "mamba_d_conv": get("ssm.conv_kernel"),
            "mamba_conv_bias": "blk.0.ssm_conv1d.bias" in shapes,
            "mamba_proj_bias": "blk.0.ssm_in.bias" in shapes,
            "projectors_bias": "blk.0.ssm_in.bias" in shapes,
            "mamba_rms_norm": "blk.0.ssm_norm.weight" in shapes,
            "mamba_norm_before_gate": False,
            "attention_bias": "blk.0.attn_q.bias" in shapes,
            "tie_word_embeddings": "output.weight" not in shapes}


def gguf_tensors(tensors: dict, hf: dict, source: str) -> dict:
    """llama.cpp's falcon-h1 tensors by transformers' names: ``A = -exp(A_log)``, D, the
    gated norm's groups and the 2-D convolution undone (q and k are not permuted: its
    rotary is NeoX-style, as transformers')."""
    out = {}
    for name, w in tensors.items():
        base, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):       # ssm_a, ssm_d have no suffix
            base, suffix = name, "weight"
        if base in ("token_embd", "output_norm", "output"):
            out[{"token_embd": "model.embed_tokens", "output_norm": "model.final_layernorm",
                 "output": "lm_head"}[base] + f".{suffix}"] = w
            continue
        parts = base.split(".", 2)
        if base == "rope_freqs" or len(parts) == 3 and parts[2] == "rope_freqs":
            continue                                 # derived from rope.freq_base
        if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _GGUF_BLOCK:
            raise ValueError(f"{source} has tensor {name!r}, which has no place in a "
                             f"Falcon-H1 model")
        _, i, kind = parts
        w, bare = mamba2_gguf_tensor(kind, suffix, w)
        key = f"model.layers.{i}.{_GGUF_BLOCK[kind]}"
        out[key if bare else f"{key}.{suffix}"] = w
    return out


FAMILY = register_family(Family((KIND,), "FalconH1ForCausalLM", to_config, to_state,
                                from_config, from_state,
                                GgufMapping(("falcon-h1",), gguf_config, gguf_tensors),
                                fold=fold))

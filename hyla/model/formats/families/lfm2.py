"""LFM2 (``lfm2``, Liquid AI): gated short convolutions mixed with attention.

What maps onto hyla, read from transformers' ``modeling_lfm2.py``:

- ``layer_types``: ``"conv"`` is ``C`` (``Lfm2ShortConv``: ``in_proj`` to B, C, x,
  ``C * conv(B * x)`` with ``conv_L_cache`` taps, ``out_proj``; biases with ``conv_bias``;
  its options in ``mixer_options["short_conv"]``); ``"full_attention"`` is ``A`` with a
  per-head RMSNorm on q and k (``q_layernorm`` / ``k_layernorm`` -> ``q_norm`` / ``k_norm``)
  and ``out_proj`` -> ``o_proj``. ``full_attn_idxs`` stands for ``layer_types`` in older
  files;
- the FFN is SwiGLU (``w1`` gate, ``w3`` up, ``w2`` down) whose width transformers adjusts
  when ``block_auto_adjust_ff_dim`` (2/3 of ``intermediate_size``, times
  ``block_ffn_dim_multiplier``, rounded up to ``block_multiple_of``): hyla keeps the
  adjusted width, and export writes it with the adjustment off;
- ``operator_norm`` / ``ffn_norm`` are the block norms, and ``embedding_norm``, despite its
  name, the final norm (applied after the last layer).

Example:
    >>> from hyla.model.formats.families import FAMILIES
    >>> FAMILIES["lfm2"].architecture
    'Lfm2ForCausalLM'
"""

from __future__ import annotations

from hyla.model.config import HylaConfig
from hyla.model.formats.families.base import (
    Family,
    GgufMapping,
    check_all_taken,
    gguf_shape,
    gguf_value,
    head_from_hyla,
    head_to_hyla,
    refuse,
    register_family,
    require,
    take,
)
from hyla.model.layers import rope_from_hf_config
from hyla.model.mixers import MIXERS

KIND = "lfm2"
LETTERS = {"conv": "C", "full_attention": "A"}
_REFUSED = {"hidden_act": lambda v: v in ("silu", "swish")}


def ffn_width(hf: dict) -> int:
    """The SwiGLU width transformers builds (``Lfm2MLP``'s adjustment).

    Example:
        >>> ffn_width({"intermediate_size": 12288, "block_ffn_dim_multiplier": 1.0,
        ...            "block_multiple_of": 256, "block_auto_adjust_ff_dim": True})
        8192
    """
    width = int(hf.get("intermediate_size") or hf.get("block_ff_dim") or 12288)
    if hf.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            step = int(hf.get("block_multiple_of", 256))
            width = step * ((int(multiplier * width) + step - 1) // step)
    return width


def to_config(hf: dict, source: str) -> HylaConfig:
    refuse(hf, source, _REFUSED)
    n = int(require(hf, "num_hidden_layers", source, KIND))
    heads = int(require(hf, "num_attention_heads", source, KIND))
    types = hf.get("layer_types")
    if types is None:
        full = hf.get("full_attn_idxs")
        full = range(n) if full is None else set(full)
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    types = list(types)
    if len(types) != n or not set(types) <= set(LETTERS):
        raise ValueError(f"{source}: layer_types {types!r} must be {n} of {list(LETTERS)}")
    d = int(require(hf, "hidden_size", source, KIND))
    head_dim = int(hf.get("head_dim") or d // heads)
    theta, scaling = rope_from_hf_config({"rope_theta": 1e6, **hf}, source)
    try:
        return HylaConfig(
            vocab_size=int(require(hf, "vocab_size", source, KIND)), d_model=d,
            layers="".join(LETTERS[t] for t in types), n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads), ffn_dim=ffn_width(hf),
            norm_eps=float(hf.get("norm_eps", 1e-5)), rope_theta=theta, rope_scaling=scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", hf.get("tie_embedding", True))),
            initializer_range=float(hf.get("initializer_range", 0.02)), qk_norm=True,
            attention_head_dim=None if head_dim * heads == d else head_dim,
            mixer_options={"short_conv": {"kernel": int(hf.get("conv_L_cache", 3)),
                                          "bias": bool(hf.get("conv_bias", False))}},
            family=KIND)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _layer_names(cfg: HylaConfig, i: int) -> dict[str, str]:
    """hyla block suffix -> transformers decoder-layer suffix."""
    names = {"mixer_norm.weight": "operator_norm.weight", "mlp_norm.weight": "ffn_norm.weight",
             "mlp.gate_proj.weight": "feed_forward.w1.weight",
             "mlp.up_proj.weight": "feed_forward.w3.weight",
             "mlp.down_proj.weight": "feed_forward.w2.weight"}
    if cfg.layers[i] == "C":
        parts = ("in_proj", "conv", "out_proj")
        names |= {f"mixer.{p}.weight": f"conv.{p}.weight" for p in parts}
        if MIXERS["C"].options(cfg.layer_config(i)).bias:
            names |= {f"mixer.{p}.bias": f"conv.{p}.bias" for p in parts}
        return names
    names |= {f"mixer.{p}.weight": f"self_attn.{p}.weight" for p in ("q_proj", "k_proj",
                                                                     "v_proj")}
    return names | {"mixer.o_proj.weight": "self_attn.out_proj.weight",
                    "mixer.q_norm.weight": "self_attn.q_layernorm.weight",
                    "mixer.k_norm.weight": "self_attn.k_layernorm.weight"}


def to_state(weights: dict, cfg: HylaConfig, source: str) -> dict:
    weights = dict(weights)
    if "model.embedding_norm.weight" in weights:        # the final norm, by its LFM2 name
        weights["model.norm.weight"] = weights.pop("model.embedding_norm.weight")
    out = head_to_hyla(weights, cfg, source)
    for i in range(cfg.n_layers):
        for ours, theirs in _layer_names(cfg, i).items():
            out[f"blocks.{i}.{ours}"] = take(weights, f"model.layers.{i}.{theirs}", source)
    check_all_taken(weights, source)
    return out


def from_state(state: dict, cfg: HylaConfig) -> dict:
    out = head_from_hyla(state, cfg)
    out["model.embedding_norm.weight"] = out.pop("model.norm.weight")
    for i in range(cfg.n_layers):
        for ours, theirs in _layer_names(cfg, i).items():
            out[f"model.layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
    return out


def from_config(cfg: HylaConfig) -> dict:
    """LFM2's config.json; ValueError naming what ``cfg`` has that LFM2 cannot hold."""
    if not set(cfg.layers) <= {"A", "C"}:
        raise ValueError(f"{KIND} export needs 'C' and 'A' layers only, got {cfg.layers!r}")
    conv = {MIXERS["C"].options(cfg.layer_config(i)) for i, c in enumerate(cfg.layers)
            if c == "C"}
    plain = (cfg.qk_norm and not cfg.attention_bias and not cfg.attention_out_bias
             and cfg.sliding_window is None and cfg.norm_placement == "pre"
             and not cfg.layer_overrides and not cfg.mixer_options.get("attention")
             and set(cfg.ffn_layers or "S") == {"S"} and len(conv) <= 1)
    if not plain:
        raise ValueError(f"{KIND} export: this model is not an LFM2 (per-head q/k norms, no "
                         f"biases or window, pre-norm, dense FFNs, one conv shape)")
    opts = conv.pop() if conv else MIXERS["C"].options(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    return {"architectures": ["Lfm2ForCausalLM"], "model_type": KIND,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_dim, "block_auto_adjust_ff_dim": False,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "norm_eps": cfg.norm_eps, "rope_parameters": rope,
            "max_position_embeddings": 128000, "tie_word_embeddings": cfg.tie_embeddings,
            "conv_L_cache": opts.kernel, "conv_bias": opts.bias,
            "layer_types": ["full_attention" if c == "A" else "conv" for c in cfg.layers],
            "initializer_range": cfg.initializer_range, "use_cache": True,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "torch_dtype": "float32", "dtype": "float32"}


# GGUF block tensor -> transformers decoder-layer suffix (llama.cpp's LFM2 names)
_GGUF_BLOCK = {"attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
               "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
               "ffn_down": "feed_forward.w2", "shortconv.conv": "conv.conv",
               "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.out_proj",
               "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm"}


def gguf_config(meta: dict, shapes: dict, source: str) -> dict:
    """LFM2's config.json from llama.cpp's ``lfm2.*`` metadata: the layers with KV heads
    are the attention layers, the rest convolutions; the FFN width is already adjusted."""
    arch = meta["general.architecture"]
    kv = gguf_value(meta, arch, "attention.head_count_kv", source)
    n = int(gguf_value(meta, arch, "block_count", source))
    kv = list(kv) if isinstance(kv, list) else [kv] * n
    if len(kv) != n or not any(kv):
        raise ValueError(f"{source}: {arch}.attention.head_count_kv {kv} must give {n} "
                         f"layers, some of them attention (KV heads > 0)")
    return {"model_type": KIND, "vocab_size": gguf_shape(shapes, "token_embd.weight", source)[0],
            "hidden_size": gguf_value(meta, arch, "embedding_length", source),
            "intermediate_size": gguf_value(meta, arch, "feed_forward_length", source),
            "block_auto_adjust_ff_dim": False, "num_hidden_layers": n,
            "num_attention_heads": gguf_value(meta, arch, "attention.head_count", source),
            "num_key_value_heads": max(kv),
            "layer_types": ["full_attention" if h else "conv" for h in kv],
            "norm_eps": gguf_value(meta, arch, "attention.layer_norm_rms_epsilon", source),
            "rope_theta": gguf_value(meta, arch, "rope.freq_base", source, 1e6),
            "conv_L_cache": gguf_value(meta, arch, "shortconv.l_cache", source),
            "tie_word_embeddings": "output.weight" not in shapes}


def gguf_tensors(tensors: dict, hf: dict, source: str) -> dict:
    """llama.cpp's LFM2 tensors by transformers' names (its 2-D convolution unsqueezed)."""
    out = {}
    for name, w in tensors.items():
        base, _, suffix = name.rpartition(".")
        if base == "token_embd":
            out[f"model.embed_tokens.{suffix}"] = w
        elif base == "token_embd_norm":                 # LFM2's final norm
            out[f"model.embedding_norm.{suffix}"] = w
        elif base == "output":
            out[f"lm_head.{suffix}"] = w
        elif base.startswith("blk.") and base.split(".", 2)[2] in _GGUF_BLOCK:
            _, i, kind = base.split(".", 2)
            if kind == "shortconv.conv" and suffix == "weight":
                w = w[:, None]                          # [d, kernel] -> Conv1d's [d, 1, kernel]
            out[f"model.layers.{i}.{_GGUF_BLOCK[kind]}.{suffix}"] = w
        else:
            raise ValueError(f"{source} has tensor {name!r}, which has no place in an LFM2 "
                             f"model: refused, since dropping it would change the model")
    return out


FAMILY = register_family(Family((KIND,), "Lfm2ForCausalLM", to_config, to_state,
                                from_config, from_state,
                                GgufMapping(("lfm2",), gguf_config, gguf_tensors)))

"""OLMo hybrid (``olmo_hybrid``): gated DeltaNet layers mixed with post-norm attention.

What maps onto hyla, read from transformers' ``modeling_olmo_hybrid.py``:

- ``layer_types``: ``"linear_attention"`` is ``D`` (``OlmoHybridGatedDeltaNet``: separate
  q/k/v/a/b/g projections, one short conv over q|k|v with SiLU, l2-normed q/k, beta doubled
  with ``linear_allow_neg_eigval``, a gated RMSNorm of eps 1e-5 on the output; its options
  in ``mixer_options["gated_delta"]``), pre-norm; ``"full_attention"`` is ``A`` with RMSNorm
  over the whole q and k projections (``qk_norm_scope="all"``), biases on q/k/v/o with
  ``attention_bias``, rotary from ``rope_parameters`` or none at all (NoPE: a
  ``rope_theta`` of null, which transformers reads as no rotary embedding), and post-norm
  blocks (``layer_overrides`` ``norm_placement="post"``);
- the checkpoint's names as ``save_pretrained`` writes them: ``attention_layer_norm`` /
  ``feedforward_layer_norm`` for ``input_layernorm`` / ``post_attention_layernorm``, and
  the conv's weight in three parts ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` (joined in
  order); the in-memory names are read too. Export writes the checkpoint names.

Refused (ValueError naming the file and the field): another activation, attention dropout,
a different number of linear key and value heads (transformers' layer does not repeat
them), layer types other than those two.

Example:
    >>> from hyla.model.formats.families import FAMILIES
    >>> FAMILIES["olmo_hybrid"].architecture
    'OlmoHybridForCausalLM'
"""

from __future__ import annotations

import torch

from hyla.model.config import HylaConfig
from hyla.model.formats.families.base import (
    Family,
    check_all_taken,
    head_from_hyla,
    head_to_hyla,
    refuse,
    register_family,
    require,
    take,
)
from hyla.model.layers import rope_from_hf_config
from hyla.model.mixers import MIXERS
from hyla.model.mixers.attention import AttentionMixer
from hyla.model.mixers.deltanet import delta_dims

KIND = "olmo_hybrid"
LETTERS = {"linear_attention": "D", "full_attention": "A"}
O_NORM_EPS = 1e-5           # OlmoHybridGatedDeltaNet's gated norm: fixed, not rms_norm_eps
_REFUSED = {"hidden_act": lambda v: v in ("silu", "swish"),
            "attention_dropout": lambda v: not v, "mlp_bias": lambda v: not v}
_DISK = {".attention_layer_norm.": ".input_layernorm.",          # checkpoint -> in memory
         ".feedforward_layer_norm.": ".post_attention_layernorm."}


def to_config(hf: dict, source: str) -> HylaConfig:

    refuse(hf, source, _REFUSED)
    n = int(require(hf, "num_hidden_layers", source, KIND))
    heads = int(require(hf, "num_attention_heads", source, KIND))
    types = list(require(hf, "layer_types", source, KIND))
    if len(types) != n or not set(types) <= set(LETTERS):
        raise ValueError(f"{source}: layer_types {types!r} must be {n} of {list(LETTERS)}")
    hk = int(hf.get("linear_num_key_heads") or heads)
    hv = int(hf.get("linear_num_value_heads") or heads)
    if hk != hv:
        raise ValueError(f"{source}: linear_num_key_heads={hk} != linear_num_value_heads="
                         f"{hv} is not supported: OlmoHybridGatedDeltaNet does not repeat "
                         f"key heads")
    d = int(require(hf, "hidden_size", source, KIND))
    dk = int(hf.get("linear_key_head_dim") or int(0.75 * d / hk))
    # NoPE is a rope_theta of null (rope_parameters: null gets transformers' default rope)
    rope = hf.get("rope_parameters")
    rotary = not (isinstance(rope, dict) and "rope_theta" in rope and rope["rope_theta"] is None)
    theta, scaling = rope_from_hf_config(hf, source) if rotary else (10000.0, None)
    delta = {"num_k_heads": hk, "num_v_heads": hv, "head_k_dim": dk,
             "head_v_dim": int(hf.get("linear_value_head_dim") or 2 * dk),
             "conv_kernel": int(hf.get("linear_conv_kernel_dim", 4)),
             "beta_scale": 2.0 if hf.get("linear_allow_neg_eigval", True) else 1.0,
             "o_norm_eps": O_NORM_EPS}
    bias = bool(hf.get("attention_bias", False))
    try:
        return HylaConfig(
            vocab_size=int(require(hf, "vocab_size", source, KIND)), d_model=d,
            layers="".join(LETTERS[t] for t in types), n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            ffn_dim=int(require(hf, "intermediate_size", source, KIND)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            attention_bias=bias, attention_out_bias=bias, qk_norm=True,
            mixer_options={"attention": {"qk_norm_scope": "all", "rotary": rotary},
                           "gated_delta": delta},
            layer_overrides=[{"norm_placement": "post"} if t == "full_attention" else {}
                             for t in types],
            family=KIND)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _layer_names(cfg: HylaConfig, i: int) -> dict[str, str]:
    """hyla block suffix -> transformers decoder-layer suffix (in-memory names)."""
    names = {f"mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj",
                                                            "down_proj")}
    if cfg.layers[i] == "D":
        names |= {"mixer_norm.weight": "input_layernorm.weight",
                  "mlp_norm.weight": "post_attention_layernorm.weight",
                  "mixer.conv.weight": "linear_attn.conv1d.weight",
                  "mixer.A_log": "linear_attn.A_log", "mixer.dt_bias": "linear_attn.dt_bias",
                  "mixer.o_norm.weight": "linear_attn.o_norm.weight"}
        names |= {f"mixer.{p}.weight": f"linear_attn.{p}.weight"
                  for p in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj",
                            "o_proj")}
        return names
    names |= {"mixer_norm.weight": "post_attention_layernorm.weight",
              "mlp_norm.weight": "post_feedforward_layernorm.weight",
              "mixer.q_norm.weight": "self_attn.q_norm.weight",
              "mixer.k_norm.weight": "self_attn.k_norm.weight"}
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"mixer.{p}.weight"] = f"self_attn.{p}.weight"
        if cfg.attention_bias:
            names[f"mixer.{p}.bias"] = f"self_attn.{p}.bias"
    return names


def _in_memory(weights: dict) -> dict:
    """A checkpoint's tensors by transformers' in-memory names (its load-time renames)."""
    out = {}
    for key, tensor in weights.items():
        for disk, mem in _DISK.items():
            key = key.replace(disk, mem)
        out[key] = tensor
    for key in [k for k in out if k.endswith(".linear_attn.q_conv1d.weight")]:
        stem = key[:-len("q_conv1d.weight")]
        parts = [out.pop(f"{stem}{p}_conv1d.weight", None) for p in "qkv"]
        if any(p is None for p in parts):
            raise ValueError(f"{stem}: q_conv1d, k_conv1d and v_conv1d come together")
        out[f"{stem}conv1d.weight"] = torch.cat(parts)
    return out


def to_state(weights: dict, cfg: HylaConfig, source: str) -> dict:
    weights = _in_memory(weights)
    out = head_to_hyla(weights, cfg, source)
    for i in range(cfg.n_layers):
        for ours, theirs in _layer_names(cfg, i).items():
            out[f"blocks.{i}.{ours}"] = take(weights, f"model.layers.{i}.{theirs}", source)
    check_all_taken(weights, source)
    return out


def from_state(state: dict, cfg: HylaConfig) -> dict:
    out = head_from_hyla(state, cfg)
    for i in range(cfg.n_layers):
        for ours, theirs in _layer_names(cfg, i).items():
            key, tensor = f"model.layers.{i}.{theirs}", state[f"blocks.{i}.{ours}"]
            if theirs == "linear_attn.conv1d.weight":       # the checkpoint's three parts
                hk, _, dk, _ = delta_dims(cfg.layer_config(i), _delta(cfg, i))
                kd = hk * dk
                for p, part in zip("qkv", tensor.split([kd, kd, tensor.shape[0] - 2 * kd]),
                                   strict=True):
                    out[key.replace("conv1d", f"{p}_conv1d")] = part.contiguous()
                continue
            for disk, mem in _DISK.items():      # save_pretrained's names, every layer
                key = key.replace(mem, disk)
            out[key] = tensor
    return out


def _delta(cfg: HylaConfig, i: int):
    return MIXERS["D"].options(cfg.layer_config(i))


def from_config(cfg: HylaConfig) -> dict:
    """OLMo hybrid's config.json; ValueError naming the field when ``cfg`` is not one."""
    if not set(cfg.layers) <= {"A", "D"} or "D" not in cfg.layers or "A" not in cfg.layers:
        raise ValueError(f"{KIND} export needs 'D' and 'A' layers only, got {cfg.layers!r}")
    d_layers = [i for i, c in enumerate(cfg.layers) if c == "D"]
    delta = _delta(cfg, d_layers[0])
    att = AttentionMixer.options(cfg.layer_config(cfg.layers.index("A")))
    for i, c in enumerate(cfg.layers):
        layer = cfg.layer_config(i)
        post = layer.norm_placement == "post"
        bad = (post != (c == "A") or (c == "D" and _delta(cfg, i) != delta)
               or (c == "A" and (AttentionMixer.options(layer) != att or not layer.qk_norm
                                 or att.qk_norm_scope != "all" or layer.sliding_window
                                 or layer.attention_bias != layer.attention_out_bias)))
        if bad or (cfg.ffn_layers and cfg.ffn_layers[i] != "S"):
            raise ValueError(f"{KIND} export: layer {i} ({c}) is not an OLMo hybrid layer "
                             f"(post-norm attention with whole-projection q/k norms, "
                             f"pre-norm D layers of one shape, dense FFNs)")
    hk, hv, dk, dv = delta_dims(cfg.layer_config(d_layers[0]), delta)
    if delta.o_norm_eps != O_NORM_EPS or delta.beta_scale not in (1.0, 2.0) or hk != hv \
            or delta.gate_rank or delta.decay_rank or delta.safe_gate \
            or delta.gate_act != "silu":
        raise ValueError(f"{KIND} export: mixer_options['gated_delta'] {delta} is not "
                         f"OlmoHybridGatedDeltaNet's")
    rope = {"rope_type": "default", "rope_theta": None}          # NoPE, as transformers reads it
    if att.rotary:
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling:
            rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    return {"architectures": ["OlmoHybridForCausalLM"], "model_type": KIND,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
            "max_position_embeddings": 65536, "tie_word_embeddings": cfg.tie_embeddings,
            "attention_bias": cfg.layer_config(cfg.layers.index("A")).attention_bias,
            "attention_dropout": 0.0, "initializer_range": cfg.initializer_range,
            "layer_types": ["full_attention" if c == "A" else "linear_attention"
                            for c in cfg.layers],
            "linear_num_key_heads": hk, "linear_num_value_heads": hv,
            "linear_key_head_dim": dk, "linear_value_head_dim": dv,
            "linear_conv_kernel_dim": delta.conv_kernel,
            "linear_allow_neg_eigval": delta.beta_scale == 2.0, "use_cache": True,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "torch_dtype": "float32", "dtype": "float32"}


FAMILY = register_family(Family((KIND,), "OlmoHybridForCausalLM", to_config, to_state,
                                from_config, from_state))

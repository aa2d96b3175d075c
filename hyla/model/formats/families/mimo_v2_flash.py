"""MiMo-V2-Flash (``mimo_v2_flash``): window and full attention layers, MoE.

What maps onto hyla, read from transformers' ``modeling_mimo_v2_flash.py``:

- every layer is ``A``: ``layer_types`` picks full or sliding-window attention; the window
  layers (``layer_overrides``) have twice the KV heads, their own rope parameters, the window
  and learned per-head sinks (``AttentionOptions.sinks``); every layer has a q/k head dim of
  ``head_dim``, a value head dim of ``v_head_dim`` (``value_head_dim``), values scaled by
  ``attention_value_scale`` (``value_scale``) and rotary on the first
  ``partial_rotary_factor`` of each head (0.334 when a layer type's rope parameters do not
  say, as transformers reads it); q/k/v biases with ``attention_bias``, no o bias;
- ``mlp_layer_types``: ``"dense"`` SwiGLU (``S``, ``intermediate_size``) or ``"sparse"``
  MoE (``E``): sigmoid router with ``e_score_correction_bias``, group-limited top-k
  (``n_group``, ``topk_group``), ``norm_topk_prob``, ``routed_scaling_factor``, no shared
  expert;
- multi-token-prediction layers (``model.mtp.layers.{j}.*``, which transformers leaves
  out) load into :class:`hyla.model.mtp.MTPHead` (``--speculative mtp``) and export back,
  laid out as vLLM and SGLang read them: each layer its own ``enorm``, ``hnorm``,
  ``eh_proj`` and ``final_layernorm`` around a block built like the stack's window layers
  (window, sinks, their heads and rope) with a dense FFN (``pre_mlp_layernorm`` its second
  norm).

Refused (ValueError naming the file and the field): another activation, non-default rope
types, attention dropout, fields of the original release that transformers' class ignores
but that would change the model (shared experts, sinks on full layers, window layers of
other shapes, a layer pattern that disagrees with ``layer_types``).

Example:
    >>> from hyla.model.formats.families import FAMILIES
    >>> FAMILIES["mimo_v2_flash"].architecture
    'MiMoV2FlashForCausalLM'
"""

from __future__ import annotations

import dataclasses

from hyla.model.config import HylaConfig
from hyla.model.formats.families.base import (
    Family,
    MoENames,
    check_all_taken,
    head_from_hyla,
    head_to_hyla,
    moe_from_hyla,
    moe_to_hyla,
    refuse,
    register_family,
    require,
    take,
)
from hyla.model.mixers.attention import AttentionMixer

KIND = "mimo_v2_flash"
TYPES = ("full_attention", "sliding_attention")
NAMES = MoENames()
_REFUSED = {        # fields transformers' class ignores; values other than these change the model
    "hidden_act": lambda v: v in ("silu", "swish"),
    "attention_dropout": lambda v: not v,
    "n_shared_experts": lambda v: not v,
    "add_full_attention_sink_bias": lambda v: not v,
    "scoring_func": lambda v: v == "sigmoid",
    "topk_method": lambda v: v in ("noaux_tc", "greedy"),
    "mlp_bias": lambda v: not v,
}


def _rope(hf: dict, kind: str, source: str) -> tuple[float, float]:
    """(theta, partial_rotary_factor) of one layer type."""
    params = hf.get("rope_parameters") or {}
    if set(params) - set(TYPES) or not isinstance(params.get(kind, {}), dict):
        raise ValueError(f"{source}: rope_parameters must map {list(TYPES)} to their rope "
                         f"parameters, got {params!r}")
    p = dict(params.get(kind) or {})
    if p.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope_parameters[{kind!r}].rope_type="
                         f"{p['rope_type']!r} is not supported: expected 'default'")
    extra = sorted(set(p) - {"rope_type", "rope_theta", "partial_rotary_factor"})
    if extra:
        raise ValueError(f"{source}: rope_parameters[{kind!r}] has unsupported {extra}")
    return float(require(p, "rope_theta", source, KIND)), float(
        p.get("partial_rotary_factor", 0.334))


# MiMoV2FlashConfig's defaults, for fields a config.json leaves out
_DEFAULTS = {"num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128,
             "sliding_window": 129, "attention_value_scale": 0.707, "rms_norm_eps": 1e-5,
             "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
             "routed_scaling_factor": 1.0, "attention_bias": False}


def _as_transformers_reads(hf: dict, source: str) -> dict:
    """``hf`` with what ``MiMoV2FlashConfig.__post_init__`` fills in or converts."""
    hf = {**_DEFAULTS, **hf}
    n = int(require(hf, "num_hidden_layers", source, KIND))
    if hf.get("layer_types") is None:     # full attention in layer 0 and every 6th
        hf["layer_types"] = [TYPES[not (i == 0 or not (i + 1) % 6)] for i in range(n)]
    if hf.get("mlp_layer_types") is None:
        hf["mlp_layer_types"] = ["dense"] + ["sparse"] * (n - 1)
    if hf.get("rope_parameters") is None:
        hf["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": theta,
                                     "partial_rotary_factor": 0.334}
                                 for t, theta in zip(TYPES, (5e6, 1e4), strict=True)}
    if hf.get("sliding_window_size") is not None:   # the release's count excludes the query
        hf["sliding_window"] = int(hf["sliding_window_size"]) + 1
    return hf


def to_config(hf: dict, source: str) -> HylaConfig:
    refuse(hf, source, _REFUSED)
    hf = _as_transformers_reads(hf, source)
    n = int(require(hf, "num_hidden_layers", source, KIND))
    heads, kv = int(require(hf, "num_attention_heads", source, KIND)), int(
        require(hf, "num_key_value_heads", source, KIND))
    head_dim = int(require(hf, "head_dim", source, KIND))
    types = list(require(hf, "layer_types", source, KIND))
    mlp = list(require(hf, "mlp_layer_types", source, KIND))
    if len(types) != n or not set(types) <= set(TYPES):
        raise ValueError(f"{source}: layer_types {types!r} must be {n} of {list(TYPES)}")
    if len(mlp) != n or not set(mlp) <= {"dense", "sparse"}:
        raise ValueError(f"{source}: mlp_layer_types {mlp!r} must be {n} of 'dense'/'sparse'")
    _check_release_fields(hf, types, mlp, heads, kv, head_dim, source)
    window = int(require(hf, "sliding_window", source, KIND)) \
        if "sliding_attention" in types else None
    s_theta, s_partial = _rope(hf, "sliding_attention", source) if window else (0.0, 1.0)
    theta, partial = _rope(hf, "full_attention", source) \
        if "full_attention" in types else (s_theta, s_partial)
    v_head = int(hf["v_head_dim"] or head_dim)
    scale = hf["attention_value_scale"]
    common = {"value_head_dim": v_head, "value_scale": 1.0 if scale is None else float(scale)}
    slide = {"sliding_window": window, "n_kv_heads": 2 * kv, "rope_theta": s_theta,
             "mixer_options": {"attention": {"sinks": True,
                                             "partial_rotary_factor": s_partial}}}
    moe = {"num_experts": int(require(hf, "n_routed_experts", source, KIND)),
           "top_k": int(require(hf, "num_experts_per_tok", source, KIND)),
           "expert_dim": int(require(hf, "moe_intermediate_size", source, KIND)),
           "router": "sigmoid", "score_bias": True,
           "norm_topk": bool(hf.get("norm_topk_prob", True)),
           "scaling": float(hf.get("routed_scaling_factor") or 1.0),
           "n_group": _int(hf, "n_group", 1), "topk_group": _int(hf, "topk_group", 1)}
    try:
        return HylaConfig(
            vocab_size=int(require(hf, "vocab_size", source, KIND)),
            d_model=int(require(hf, "hidden_size", source, KIND)), layers="A" * n,
            n_heads=heads, n_kv_heads=kv, ffn_dim=int(require(hf, "intermediate_size", source,
                                                              KIND)),
            attention_head_dim=head_dim, attention_bias=bool(hf.get("attention_bias", False)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            ffn_layers="".join("E" if m == "sparse" else "S" for m in mlp),
            mixer_options={"attention": common | {"partial_rotary_factor": partial}},
            ffn_options={"moe": moe} if "sparse" in mlp else {},
            layer_overrides=[slide if t == "sliding_attention" else {} for t in types],
            mtp_options=_mtp_options(types.index("sliding_attention") if window else None),
            family=KIND)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _check_release_fields(hf, types, mlp, heads, kv, head_dim, source) -> None:
    """The original release's own fields, where present, must say what transformers reads."""
    want = {"hybrid_layer_pattern": [int(t == "sliding_attention") for t in types],
            "moe_layer_freq": [int(m == "sparse") for m in mlp],
            "swa_num_attention_heads": heads, "swa_num_key_value_heads": 2 * kv,
            "swa_head_dim": head_dim, "swa_v_head_dim": hf.get("v_head_dim") or head_dim,
            "add_swa_attention_sink_bias": True}
    for key, value in want.items():
        if key in hf and hf[key] is not None and hf[key] != value:
            raise ValueError(f"{source}: {key}={hf[key]!r} is not supported: transformers' "
                             f"MiMoV2Flash (and hyla) compute {value!r} from the other fields")




def _layer_names(cfg: HylaConfig, i: int) -> dict[str, str]:
    """hyla block suffix -> MiMo decoder-layer suffix, for layer ``i``'s non-MoE tensors."""
    layer = cfg.layer_config(i)
    names = {"mixer_norm.weight": "input_layernorm.weight",
             "mlp_norm.weight": "post_attention_layernorm.weight"}
    names |= {f"mixer.{p}.weight": f"self_attn.{p}.weight"
              for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    if layer.attention_bias:
        names |= {f"mixer.{p}.bias": f"self_attn.{p}.bias" for p in ("q_proj", "k_proj",
                                                                       "v_proj")}
    if AttentionMixer.options(layer).sinks:     # what save_pretrained writes for `sinks`
        names["mixer.sinks"] = "self_attn.attention_sink_bias"
    if cfg.ffn_letter(i) == "S":
        names |= {f"mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj",
                                                                  "down_proj")}
    return names


# the MTP layers' own tensors, hyla's names (lists, one a layer) -> the file's
_MTP_OWN = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm",
            "pre_fc_norm_hidden": "hnorm", "norm": "final_layernorm"}
# a window layer's attention, a dense FFN, each MTP layer its own fusion (vLLM's reading)
_MTP_OPTIONS = {"ffn": "S", "per_layer_fusion": True}


def _rename(weights: dict, old: str, new: str, source: str) -> None:
    """``weights[old]`` under the name ``new`` (two names for one tensor, both in the file:
    refused, rather than one silently chosen)."""
    if new in weights:
        raise ValueError(f"{source}: holds both {old} and {new}, two names for one tensor")
    weights[new] = weights.pop(old)


def _mtp_names(cfg: HylaConfig) -> dict[str, str]:
    """hyla name -> file name of every MTP tensor (``cfg.mtp_layers`` of them)."""
    from hyla.model.mtp import mtp_config

    m, names = mtp_config(cfg), {}
    for j in range(cfg.mtp_layers):
        theirs = f"model.mtp.layers.{j}"
        names |= {f"mtp.{ours}.{j}.weight": f"{theirs}.{file}.weight"
                  for ours, file in _MTP_OWN.items()}
        for ours, file in _layer_names(m, j).items():
            file = file.replace("post_attention_layernorm", "pre_mlp_layernorm")
            names[f"mtp.layers.{j}.{ours}"] = f"{theirs}.{file}"
    return names


def _mtp_to_hyla(weights: dict, cfg: HylaConfig, source: str) -> dict:
    """The file's MTP tensors by hyla's names; ``{}`` when it holds none."""
    n = len({k.split(".")[3] for k in weights if k.startswith("model.mtp.layers.")})
    for k in [k for k in weights if k.startswith("model.mtp.layers.")
              and ".post_attention_layernorm." in k]:     # the name some conversions write
        _rename(weights, k, k.replace("post_attention_layernorm", "pre_mlp_layernorm"), source)
    names = _mtp_names(dataclasses.replace(cfg, mtp_layers=n)) if n else {}
    return {ours: take(weights, theirs, source) for ours, theirs in names.items()}


def to_state(weights: dict, cfg: HylaConfig, source: str) -> dict:
    weights = dict(weights)
    for k in [k for k in weights if k.endswith(".self_attn.sinks")]:   # in-memory name
        _rename(weights, k, k.replace(".sinks", ".attention_sink_bias"), source)
    out = head_to_hyla(weights, cfg, source)
    for i in range(cfg.n_layers):
        for ours, theirs in _layer_names(cfg, i).items():
            out[f"blocks.{i}.{ours}"] = take(weights, f"model.layers.{i}.{theirs}", source)
        if cfg.ffn_letter(i) == "E":
            opts = _moe_options(cfg, i)
            out |= moe_to_hyla(weights, f"model.layers.{i}.mlp", f"blocks.{i}.mlp", opts,
                               NAMES, source)
    out |= _mtp_to_hyla(weights, cfg, source)
    check_all_taken(weights, source)
    return out


def _moe_options(cfg: HylaConfig, i: int):
    from hyla.model.ffn import FFNS

    return FFNS["E"].options(cfg.layer_config(i))


def from_state(state: dict, cfg: HylaConfig) -> dict:
    out = head_from_hyla(state, cfg)
    for i in range(cfg.n_layers):
        for ours, theirs in _layer_names(cfg, i).items():
            out[f"model.layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
        if cfg.ffn_letter(i) == "E":
            out |= moe_from_hyla(state, f"blocks.{i}.mlp", f"model.layers.{i}.mlp",
                                 _moe_options(cfg, i), NAMES)
    out |= {theirs: state[ours] for ours, theirs in _mtp_names(cfg).items()}
    return out


def from_config(cfg: HylaConfig) -> dict:
    """MiMo's config.json; ValueError naming the field when ``cfg`` is not a MiMo shape."""
    if set(cfg.layers) != {"A"}:
        raise ValueError(f"{KIND} export needs every layer 'A', got layers={cfg.layers!r}")
    layers = [cfg.layer_config(i) for i in range(cfg.n_layers)]
    full = [c for c in layers if c.sliding_window is None]
    slide = [c for c in layers if c.sliding_window is not None]
    opts = AttentionMixer.options(cfg)
    for c in layers:
        o = AttentionMixer.options(c)
        sliding = c.sliding_window is not None
        ref = slide[0] if sliding else full[0]
        if (o.sinks != sliding or c.n_kv_heads != cfg.n_kv_heads * (2 if sliding else 1)
                or c.rope_theta != ref.rope_theta or c.sliding_window != ref.sliding_window
                or o.partial_rotary_factor != AttentionMixer.options(ref).partial_rotary_factor
                or o.output_gate or o.qk_norm_scope != opts.qk_norm_scope or c.qk_norm
                or o.value_head_dim != opts.value_head_dim or o.value_scale != opts.value_scale
                or c.attention_out_bias or c.rope_scaling or c.norm_placement != "pre"):
            raise ValueError(f"{KIND} export: layer_overrides do not give MiMo's layers (window "
                             f"layers: sinks, twice the KV heads, one window and rope theta; "
                             f"full layers: neither), got {c.sliding_window=} {c.n_kv_heads=} "
                             f"{o}")
    rope = {}
    for kind, group in (("full_attention", full), ("sliding_attention", slide or full)):
        rope[kind] = {"rope_type": "default", "rope_theta": group[0].rope_theta,
                      "partial_rotary_factor":
                          AttentionMixer.options(group[0]).partial_rotary_factor}
    hf = {"architectures": ["MiMoV2FlashForCausalLM"], "model_type": KIND,
          "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
          "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
          "head_dim": cfg.head_dim, "v_head_dim": AttentionMixer.value_head_dim(cfg),
          "attention_value_scale": opts.value_scale, "hidden_act": "silu",
          "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
          "max_position_embeddings": 32768, "tie_word_embeddings": cfg.tie_embeddings,
          "attention_bias": cfg.attention_bias, "attention_dropout": 0.0,
          "initializer_range": cfg.initializer_range,
          "sliding_window": slide[0].sliding_window if slide else 128,
          "layer_types": ["sliding_attention" if c.sliding_window else "full_attention"
                          for c in layers],
          "mlp_layer_types": ["sparse" if cfg.ffn_letter(i) == "E" else "dense"
                              for i in range(cfg.n_layers)],
          "use_cache": True, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
          "torch_dtype": "float32", "dtype": "float32"}
    if cfg.mtp_layers:      # what vLLM and SGLang read (transformers leaves model.mtp.* out)
        if cfg.mtp_options != _expected_mtp_options(cfg):
            raise ValueError(f"{KIND} export: the MTP layers must be built as MiMo's are "
                             f"(mtp_options {_expected_mtp_options(cfg)}), got "
                             f"{cfg.mtp_options}")
        hf["num_nextn_predict_layers"] = cfg.mtp_layers
    if "E" in (cfg.ffn_layers or ""):
        o = _moe_options(cfg, (cfg.ffn_layers or "").index("E"))
        if o.router != "sigmoid" or not o.score_bias or o.shared_dim:
            raise ValueError(f"{KIND} export: ffn_options['moe'] must be a sigmoid router with "
                             f"score_bias and no shared expert, got {o}")
        hf |= {"n_routed_experts": o.num_experts, "num_experts_per_tok": o.top_k,
               "moe_intermediate_size": o.expert_dim, "norm_topk_prob": o.norm_topk,
               "routed_scaling_factor": o.scaling, "n_group": o.n_group,
               "topk_group": o.topk_group}
    return hf


def _mtp_options(first_window_layer: int | None) -> dict:
    """MiMo's MTP layers: built like its first window layer (if any), MiMo's layout."""
    return _MTP_OPTIONS | ({} if first_window_layer is None else {"like": first_window_layer})


def _expected_mtp_options(cfg: HylaConfig) -> dict:
    slide = [i for i in range(cfg.n_layers) if cfg.layer_config(i).sliding_window]
    return _mtp_options(slide[0] if slide else None)


FAMILY = register_family(Family((KIND,), "MiMoV2FlashForCausalLM", to_config, to_state,
                                from_config, from_state))


def _int(hf: dict, key: str, default: int) -> int:
    """``hf[key]`` as an int, ``default`` only when absent (a 0 is refused downstream, not
    replaced)."""
    return default if hf.get(key) is None else int(hf[key])

"""Ring-2.5 / Ling 3 (``bailing_hybrid``): KDA linear layers (``K``), MLA layers (``M``) the
last of every ``layer_group_size``, a DeepSeek-V3 MoE (``E``) after
``first_k_dense_replace`` dense layers (``S``). The tensor mapping and the MoE are shared
with Kimi Linear (:mod:`.mla_kda`); what differs, as transformers' ``BailingHybridForCausalLM``
computes it:

- MLA with DeepSeek's interleaved RoPE on the shared key and the queries' rope parts
  (``rope_parameters``: default or a scaled RoPE, yarn's ``mscale_all_dim`` correcting the
  softmax scale) and a head-wise sigmoid output gate (``g_proj``);
- KDA with full-rank gates (``f_proj`` -> ``a_proj``, ``g_proj``), ``A_log`` [H], and the
  bounded forget gate ``kda_lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` when
  ``kda_safe_gate``; as many KDA heads as attention heads, of ``head_dim``;
- the file's names: ``model.word_embeddings``, ``layers.<i>.attention`` (``dense`` the output
  projection), ``mlp.gate.expert_bias``.

Multi-token-prediction layers (``num_nextn_predict_layers`` after the decoder) are dropped
with a logged note. Refused (ValueError naming config.json and the field): q/k norms, qkv
biases, routers other than sigmoid with an expert bias, a shared-expert width other than
``moe_intermediate_size * num_shared_experts``, non-interleaved rotary or rotary over other
than ``qk_rope_head_dim`` (a partial rotary with a scaled RoPE: transformers ignores
``partial_rotary_factor`` only with the default one), low-rank KDA gates
(``no_kda_lora: false``), output gates other than head-wise, KV heads other than the heads,
quantized files.
"""

from __future__ import annotations

import torch

from hyla.model.config import HylaConfig
from hyla.model.formats.families.base import Family, refuse, register_family, require
from hyla.model.formats.families.mla_kda import (
    LAYER_TYPES,
    check_common,
    check_exportable,
    config_common,
    drop_mtp,
    ffn_layers,
    get,
    letters,
    make_config,
    mla_options,
    rename,
    state_from_hyla,
    state_to_hyla,
    with_defaults,
)
from hyla.model.layers import rope_from_hf_config
from hyla.model.mixers import MIXERS

BAILING = "bailing_hybrid"
_IN = [(r"^model\.word_embeddings\.", "model.embed_tokens."), (r"\.attention\.", ".self_attn."),
       (r"\.self_attn\.forget_gate\.", ".self_attn."),
       (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
       (r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias")]
_OUT = [(r"^model\.embed_tokens\.", "model.word_embeddings."),
        (r"\.self_attn\.o_proj\.", ".self_attn.dense."), (r"\.self_attn\.", ".attention."),
        (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.gate.expert_bias")]


# transformers 5.24's BailingHybridConfig defaults, for the fields a file leaves out
DEFAULTS = {
    "vocab_size": 157184, "hidden_size": 2560, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 42, "num_attention_heads": 32,
    "num_shared_experts": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "num_experts": 512, "num_experts_per_token": 8, "num_expert_group": 8, "topk_group": 4,
    "moe_renormalize": True, "first_k_dense_replace": 2, "rms_norm_eps": 1e-6,
    "model_max_length": 262144, "rope_theta": 6_000_000.0, "head_dim": 128,
    "short_conv_kernel_size": 4, "layer_group_size": 6, "kda_safe_gate": True,
    "kda_lower_bound": -5.0}


def to_config(hf: dict, source: str) -> HylaConfig:
    hf = with_defaults(hf, DEFAULTS)
    check_common(hf, source, BAILING)
    rope_dim = int(hf["qk_rope_head_dim"])
    refuse(hf, source, {"use_qk_norm": lambda v: not v, "use_qkv_bias": lambda v: not v,
                        "score_function": lambda v: v in (None, "sigmoid"),
                        "scoring_func": lambda v: v in (None, "sigmoid"),
                        "moe_router_enable_expert_bias": lambda v: v in (None, True),
                        "rope_interleave": lambda v: v in (None, True),
                        "rotary_dim": lambda v: v in (None, rope_dim),
                        "qk_head_dim": lambda v: v in (None, rope_dim + int(
                            hf["qk_nope_head_dim"])),
                        "no_kda_lora": lambda v: v in (None, True),
                        "gated_attention_proj_granularity_type": lambda v: v in (
                            None, "head_wise"),
                        "use_rmsnorm": lambda v: v in (None, True)},
           "transformers' Ring-2.5 (no q/k norm or qkv bias, sigmoid router with expert "
           "bias, interleaved rotary over qk_rope_head_dim, full-rank KDA gates, head-wise "
           "output gate) is what hyla maps")
    n = int(require(hf, "num_hidden_layers", source, BAILING))
    heads = int(hf["num_attention_heads"])
    group = int(hf["layer_group_size"])
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n)]
    layers = letters(types, LAYER_TYPES, n, source, "layer_types")
    ffn = ffn_layers(hf, n, source)
    if "E" in ffn and hf.get("moe_shared_expert_intermediate_size") is not None:
        want = int(hf["moe_intermediate_size"]) * int(hf["num_shared_experts"] or 0)
        refuse(hf, source, {"moe_shared_expert_intermediate_size": lambda v: v == want},
               f"transformers' shared experts are moe_intermediate_size * num_shared_experts "
               f"= {want} wide")
    # transformers keeps the KDA head dim in ``head_dim`` (hub files) or, once it has saved
    # the config itself, in ``linear_head_dim`` (``head_dim`` then holds the rope dim).
    head_dim = int(get(hf, "linear_head_dim", "head_dim"))
    options = {}
    if "M" in layers:
        options["mla"] = mla_options(hf, source, BAILING, rope="interleaved", output_gate=True)
    if "K" in layers:
        options["kda"] = {
            "num_k_heads": int(get(hf, "linear_num_heads", default=heads)),
            "head_k_dim": head_dim, "head_v_dim": head_dim, "gate_act": "sigmoid",
            "conv_kernel": int(get(hf, "linear_conv_kernel_dim", "short_conv_kernel_size")),
            "safe_gate": bool(hf["kda_safe_gate"]),
            "lower_bound": float(hf["kda_lower_bound"])}

    rope_hf = hf | {"max_position_embeddings": hf["model_max_length"]}
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if params.get("rope_type", params.get("type", "default")) == "default":
        # transformers' default rotary here always turns the qk_rope_head_dim part, whatever
        # partial_rotary_factor says (the hub files' 0.5 of head_dim is that part)
        params.pop("partial_rotary_factor", None)
        rope_hf |= {"partial_rotary_factor": None, "rope_scaling": None,
                    "rope_parameters": params or None}
    theta, scaling = rope_from_hf_config(rope_hf, source)
    return make_config(hf, source, BAILING, layers, ffn, mixer_options=options,
                       norm_eps=float(hf["rms_norm_eps"]), rope_theta=theta,
                       rope_scaling=scaling)


def to_state(weights: dict, cfg: HylaConfig, source: str) -> dict[str, torch.Tensor]:
    return state_to_hyla(rename(drop_mtp(weights, cfg.n_layers, source), _IN), cfg, source)


def check(cfg: HylaConfig) -> None:
    """ValueError unless Ring-2.5's files can hold ``cfg``'s model."""
    check_exportable(cfg, BAILING, {"rope": "interleaved", "output_gate": True,
                                    "latent_norm_eps": 1e-6},
                     {"num_k_heads": lambda v, o: v in (None, cfg.n_heads),
                      "num_v_heads": lambda v, o: v in (None, o.num_k_heads),
                      "head_v_dim": lambda v, o: v == o.head_k_dim,
                      "decay_rank": None, "gate_rank": None, "gate_act": "sigmoid",
                      "beta_scale": 1.0, "o_norm_eps": None})


def from_config(cfg: HylaConfig) -> dict:
    check(cfg)
    hf = {"architectures": ["BailingHybridForCausalLM"], "model_type": BAILING,
          "num_nextn_predict_layers": 0} | config_common(cfg)
    max_positions = 262144
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
        if rope["rope_type"] == "dynamic":      # transformers' length for dynamic scaling
            max_positions = rope.pop("original_max_position_embeddings")
    hf |= {"rope_parameters": rope, "rope_theta": cfg.rope_theta,
           "max_position_embeddings": max_positions}
    if "K" in cfg.layers:
        o = MIXERS["K"].options(cfg)
        hf |= {"head_dim": o.head_k_dim or cfg.head_k_dim,
               "short_conv_kernel_size": o.conv_kernel,
               "kda_safe_gate": o.safe_gate, "kda_lower_bound": o.lower_bound}
    return hf


def from_state(state: dict, cfg: HylaConfig) -> dict[str, torch.Tensor]:
    check(cfg)
    return rename(state_from_hyla(state, cfg, lambda h: (h,)), _OUT)


register_family(Family((BAILING,), "BailingHybridForCausalLM", to_config, to_state,
                       from_config, from_state))

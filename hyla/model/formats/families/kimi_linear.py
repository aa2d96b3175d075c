"""Kimi Linear (``kimi_linear``): KDA linear layers (``K``), NoPE MLA layers (``M``) and a
DeepSeek-V3 MoE (``E``, sigmoid router with a score-correction bias and group-limited top-k,
shared experts) after ``first_k_dense_replace`` dense layers (``S``). The mapping it shares
with Ring-2.5 is in :mod:`.mla_kda`.

What transformers' ``KimiLinearForCausalLM`` computes and hyla maps (weights one to one):

- MLA without rotary (``rope="none"``), q LoRA optional, latent norms at eps 1e-6,
  ``attention_bias`` on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``;
- KDA: ``f_a_proj``/``f_b_proj`` -> ``a_down``/``a_proj``, ``g_a_proj``/``g_b_proj`` ->
  ``g_down``/``g_proj``, ``A_log`` [1, 1, H, 1] -> [H], the three short convs -> ``conv``,
  sigmoid-gated output norm (:class:`~hyla.model.mixers.deltanet.DeltaOptions`);
- the MoE: ``block_sparse_moe.experts.<e>.w1/w3/w2`` (gate/up/down), ``gate.weight``,
  ``gate.e_score_correction_bias``, ``shared_experts`` of width ``moe_intermediate_size *
  num_shared_experts``.

Refused (ValueError naming config.json and the field): MLA with RoPE (``mla_use_nope:
false``) or an output gate, other router activations, ``moe_layer_freq != 1``, full-rank or
bounded KDA gates (Kimi K3's ``linear_attn_config`` keys), KV heads other than the heads,
quantized files. Multi-token-prediction layers (``num_nextn_predict_layers``) are dropped
with a logged note.
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
from hyla.model.mixers import MIXERS

# -- Kimi Linear ---------------------------------------------------------------------------
KIMI = "kimi_linear"
_KIMI_IN = [(r"\.block_sparse_moe\.", ".mlp."), (r"\.self_attn\.forget_gate\.", ".self_attn."),
            (r"(\.mlp\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
            (r"(\.mlp\.experts\.\d+)\.w3\.", r"\1.up_proj."),
            (r"(\.mlp\.experts\.\d+)\.w2\.", r"\1.down_proj.")]
_KIMI_OUT = [(r"\.mlp\.", ".block_sparse_moe."),
             (r"(\.experts\.\d+)\.gate_proj\.", r"\1.w1."),
             (r"(\.experts\.\d+)\.up_proj\.", r"\1.w3."),
             (r"(\.experts\.\d+)\.down_proj\.", r"\1.w2.")]


# transformers 5.24's KimiLinearConfig defaults, for the fields a file leaves out
KIMI_DEFAULTS = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
    "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_shared_experts": 1, "routed_scaling_factor": 2.446, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "num_expert_group": 1, "topk_group": 1, "num_experts_per_token": 8,
    "moe_renormalize": True, "rms_norm_eps": 1e-5, "num_experts": 256,
    "linear_head_dim": 128, "linear_num_heads": 32, "linear_conv_kernel_dim": 4,
    "first_k_dense_replace": 1}


def kimi_to_config(hf: dict, source: str) -> HylaConfig:
    hf = with_defaults(hf, KIMI_DEFAULTS)
    check_common(hf, source, KIMI)
    lin = hf.get("linear_attn_config") or {}
    refuse(hf, source, {"mla_use_nope": lambda v: v in (None, True),
                        "mla_use_output_gate": lambda v: not v,
                        "moe_router_activation_func": lambda v: v in (None, "sigmoid"),
                        "moe_layer_freq": lambda v: v in (None, 1)},
           "transformers' Kimi Linear (NoPE MLA, sigmoid router on every layer after the "
           "dense ones) is what hyla maps")
    refuse(lin, f"{source}: linear_attn_config", {"use_full_rank_gate": lambda v: not v,
                                                  "gate_lower_bound": lambda v: v is None})
    if hf.get("use_grouped_topk") is False and int(hf["num_expert_group"] or 1) > 1:
        raise ValueError(f"{source}: use_grouped_topk=false with num_expert_group > 1 is not "
                         f"supported: transformers' router always limits groups")
    n = int(require(hf, "num_hidden_layers", source, KIMI))
    types = hf.get("layer_types")
    if types is None and "full_attn_layers" in lin and "kda_layers" in lin:
        types = [None] * n
        for key, name in (("full_attn_layers", "full_attention"),
                          ("kda_layers", "linear_attention")):
            for layer in lin[key]:              # 1-indexed in the original checkpoints
                if not 1 <= int(layer) <= n:
                    raise ValueError(f"{source}: linear_attn_config.{key} has layer {layer} "
                                     f"outside 1..{n}")
                types[int(layer) - 1] = name
    elif types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                 for i in range(n)]
    # transformers reads linear_attn_config (the released files) before linear_*
    head_dim = int(get(lin, "head_dim", default=hf["linear_head_dim"]))
    kda = {"num_k_heads": int(get(lin, "num_heads", default=hf["linear_num_heads"])),
           "head_k_dim": head_dim, "head_v_dim": head_dim, "decay_rank": head_dim,
           "gate_rank": head_dim, "gate_act": "sigmoid",
           "conv_kernel": int(get(lin, "short_conv_kernel_size",
                                  default=hf["linear_conv_kernel_dim"]))}
    layers = letters(types, LAYER_TYPES, n, source, "layer_types")
    options = {"mla": mla_options(hf, source, KIMI, rope="none")} if "M" in layers else {}
    if "K" in layers:
        options["kda"] = kda
    return make_config(hf, source, KIMI, layers, ffn_layers(hf, n, source),
                       norm_eps=float(hf["rms_norm_eps"]), mixer_options=options)


def kimi_to_state(weights: dict, cfg: HylaConfig, source: str) -> dict[str, torch.Tensor]:
    return state_to_hyla(rename(drop_mtp(weights, cfg.n_layers, source), _KIMI_IN), cfg,
                         source)


def kimi_check(cfg: HylaConfig) -> None:
    """ValueError unless Kimi Linear's files can hold ``cfg``'s model."""
    check_exportable(cfg, KIMI, {"rope": "none", "output_gate": False,
                                 "latent_norm_eps": 1e-6},
                     {"num_v_heads": lambda v, o: v in (None, o.num_k_heads),
                      "head_v_dim": lambda v, o: v == o.head_k_dim,
                      "decay_rank": lambda v, o: v == o.head_k_dim,
                      "gate_rank": lambda v, o: v == o.head_k_dim,
                      "gate_act": "sigmoid", "safe_gate": False, "beta_scale": 1.0,
                      "o_norm_eps": None})


def kimi_from_config(cfg: HylaConfig) -> dict:
    kimi_check(cfg)
    hf = {"architectures": ["KimiLinearForCausalLM"], "model_type": KIMI} | config_common(cfg)
    if "K" in cfg.layers:
        o = MIXERS["K"].options(cfg)
        hf |= {"linear_head_dim": o.head_k_dim or cfg.head_k_dim,
               "linear_num_heads": o.num_k_heads or cfg.n_heads,
               "linear_conv_kernel_dim": o.conv_kernel}
    return hf


def kimi_from_state(state: dict, cfg: HylaConfig) -> dict[str, torch.Tensor]:
    kimi_check(cfg)
    return rename(state_from_hyla(state, cfg, lambda h: (1, 1, h, 1)), _KIMI_OUT)


register_family(Family((KIMI,), "KimiLinearForCausalLM", kimi_to_config, kimi_to_state,
                       kimi_from_config, kimi_from_state))

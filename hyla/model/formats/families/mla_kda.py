"""What Kimi Linear (:mod:`.kimi_linear`) and Ring-2.5 (:mod:`.bailing_hybrid`) share:
KDA linear layers (``K``), MLA layers (``M``), DeepSeek-V3's MoE (``E``: sigmoid router with a
score-correction bias and group-limited top-k, ungated shared experts) after dense layers
(``S``).

The tensor mapping is written once over one *normal* naming (transformers' in-memory module
names: ``model.embed_tokens``, ``layers.<i>.self_attn`` with ``o_proj`` and the q/k/v convs
apart, ``mlp`` with experts ``experts.<e>.gate_proj/up_proj/down_proj``); each family renames
its file's tensors to it and back (:func:`rename`).
"""

from __future__ import annotations

import logging
import re

import torch

from hyla.model.config import HylaConfig
from hyla.model.ffn import FFNS
from hyla.model.formats.families.base import (
    MoENames,
    check_all_taken,
    moe_from_hyla,
    moe_to_hyla,
    refuse,
    require,
    take,
)
from hyla.model.mixers import MIXERS

log = logging.getLogger(__name__)
LAYER_TYPES = {"full_attention": "M", "linear_attention": "K"}
MLP_TYPES = {"dense": "S", "sparse": "E"}


# transformers writes these attributes under their attribute_map names: attribute -> name
ALIASES = {"num_local_experts": "num_experts", "n_routed_experts": "num_experts",
           "num_experts_per_tok": "num_experts_per_token",
           "n_shared_experts": "num_shared_experts", "n_group": "num_expert_group",
           "norm_topk_prob": "moe_renormalize", "max_position_embeddings": "model_max_length",
           "num_mtp_layers": "num_nextn_predict_layers"}


def with_defaults(hf: dict, defaults: dict) -> dict:
    """``hf`` under the names transformers writes (:data:`ALIASES`), the fields it leaves
    out at the family config class's defaults (``defaults``), as transformers reads it.

    Example:
        >>> with_defaults({"n_group": 4}, {"num_expert_group": 1, "topk_group": 1})
        {'num_expert_group': 4, 'topk_group': 1}
    """
    out = dict(defaults)
    for key, value in hf.items():
        out[ALIASES.get(key, key)] = value
    return out


def get(hf: dict, *names, default=None):
    """The first of ``names`` present (not None) in ``hf``."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


def check_common(hf: dict, source: str, kind: str) -> None:
    """Refusals both families share."""
    refuse(hf, source, {"hidden_act": lambda v: v in ("silu", "swish"),
                        "quantization_config": lambda v: not v,
                        "pretraining_tp": lambda v: v in (None, 1)})
    heads = require(hf, "num_attention_heads", source, kind)
    kv = hf.get("num_key_value_heads")
    if kv not in (None, heads):
        raise ValueError(f"{source}: num_key_value_heads={kv} is not supported: {kind}'s MLA "
                         f"expands one key and value per head (num_attention_heads={heads})")


def letters(types, table: dict, n: int, source: str, field: str) -> str:
    """One hyla letter a layer from a family's per-layer type list."""
    if not isinstance(types, list) or len(types) != n or any(t not in table for t in types):
        raise ValueError(f"{source}: {field}={types!r} is not supported: expected "
                         f"{n} of {sorted(table)}")
    return "".join(table[t] for t in types)


def ffn_layers(hf: dict, n: int, source: str) -> str:
    types = hf.get("mlp_layer_types")
    if types is None:
        first = int(hf.get("first_k_dense_replace") or 0)
        types = ["dense" if i < first else "sparse" for i in range(n)]
    return letters(types, MLP_TYPES, n, source, "mlp_layer_types")


def moe_options(hf: dict, source: str, kind: str) -> dict:
    """MoEOptions of the DeepSeek-V3 router these families use (``hf`` with defaults)."""
    dim = int(require(hf, "moe_intermediate_size", source, kind))
    return {"num_experts": int(require(hf, "num_experts", source, kind)),
            "top_k": int(require(hf, "num_experts_per_token", source, kind)),
            "expert_dim": dim, "router": "sigmoid", "score_bias": True,
            "shared_dim": dim * int(hf.get("num_shared_experts") or 0),
            "norm_topk": bool(hf.get("moe_renormalize", True)),
            "scaling": float(require(hf, "routed_scaling_factor", source, kind)),
            "n_group": 1 if hf.get("num_expert_group") is None else int(hf["num_expert_group"]),
            "topk_group": 1 if hf.get("topk_group") is None else int(hf["topk_group"])}


def mla_options(hf: dict, source: str, kind: str, **extra) -> dict:
    dims = {k: int(require(hf, k, source, kind)) for k in
            ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    q = hf.get("q_lora_rank")
    return dims | {"q_lora_rank": None if q is None else int(q),
                   "bias": bool(hf.get("attention_bias", False))} | extra


def drop_mtp(weights: dict, n_layers: int, source: str) -> dict:
    """Leave out the multi-token-prediction layers stored after the decoder (with a note)."""
    extra = [k for k in weights if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", k))
             and int(m.group(1)) >= n_layers]
    if extra:
        log.info("%s: left out %d multi-token-prediction tensors (layers >= %d): hyla "
                 "predicts one token", source, len(extra), n_layers)
    return {k: v for k, v in weights.items() if k not in extra}


# -- tensors, in the normal naming ---------------------------------------------------------
_KDA = {"q_proj.weight": "q_proj.weight", "k_proj.weight": "k_proj.weight",
        "v_proj.weight": "v_proj.weight", "b_proj.weight": "b_proj.weight",
        "dt_bias": "dt_bias", "o_norm.weight": "o_norm.weight", "o_proj.weight": "o_proj.weight"}
_KDA_LOW_RANK = {"a_down.weight": "f_a_proj.weight", "a_proj.weight": "f_b_proj.weight",
                 "g_down.weight": "g_a_proj.weight", "g_proj.weight": "g_b_proj.weight"}
_KDA_FULL_RANK = {"a_proj.weight": "f_proj.weight", "g_proj.weight": "g_proj.weight"}
_CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


def _mixer_names(letter: str, lc: HylaConfig) -> dict:
    """hyla mixer suffix -> normal self_attn suffix, for layer config ``lc``."""
    o = MIXERS[letter].options(lc)
    if letter == "K":
        return _KDA | (_KDA_LOW_RANK if o.decay_rank else _KDA_FULL_RANK)
    names = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
             "o_proj.weight"]
    names += ["q_proj.weight"] if o.q_lora_rank is None else [
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
    if o.output_gate:
        names.append("g_proj.weight")
    if o.bias:
        names += ["kv_a_proj_with_mqa.bias", "o_proj.bias"] + (
            [] if o.q_lora_rank is None else ["q_a_proj.bias"])
    return {n: n for n in names}


def state_to_hyla(weights: dict, cfg: HylaConfig, source: str) -> dict[str, torch.Tensor]:
    """Normal-named tensors -> hyla's (every tensor must find its place)."""
    weights = dict(weights)
    out = {"embed.weight": take(weights, "model.embed_tokens.weight", source),
           "norm.weight": take(weights, "model.norm.weight", source)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = take(weights, "lm_head.weight", source)
    for i, letter in enumerate(cfg.layers):
        lc, p, ours = cfg.layer_config(i), f"model.layers.{i}", f"blocks.{i}"
        out[f"{ours}.mixer_norm.weight"] = take(weights, f"{p}.input_layernorm.weight", source)
        out[f"{ours}.mlp_norm.weight"] = take(weights, f"{p}.post_attention_layernorm.weight",
                                              source)
        names = _mixer_names(letter, lc)
        if letter == "K":
            A = take(weights, f"{p}.self_attn.A_log", source)
            out[f"{ours}.mixer.A_log"] = A.reshape(-1)
            fused = f"{p}.self_attn.conv1d.weight"
            out[f"{ours}.mixer.conv.weight"] = take(weights, fused, source) if fused in weights \
                else torch.cat([take(weights, f"{p}.self_attn.{c}", source) for c in _CONVS])
        for mine, theirs in names.items():
            out[f"{ours}.mixer.{mine}"] = take(weights, f"{p}.self_attn.{theirs}", source)
        if cfg.ffn_letter(i) == "E":
            opts = FFNS["E"].options(lc)
            shared = f"{p}.mlp.shared_experts."
            if not opts.shared_dim:     # zero shared experts: transformers' empty MLP
                for k in [k for k in weights if k.startswith(shared)]:
                    if weights[k].numel():
                        raise ValueError(f"{source}: {k} holds weights although the config "
                                         f"declares no shared experts")
                    weights.pop(k)
            out |= moe_to_hyla(weights, f"{p}.mlp", f"{ours}.mlp", opts, MoENames(), source)
        else:
            for w in ("gate_proj", "up_proj", "down_proj"):
                out[f"{ours}.mlp.{w}.weight"] = take(weights, f"{p}.mlp.{w}.weight", source)
    check_all_taken(weights, source)
    return out


def state_from_hyla(state: dict, cfg: HylaConfig, a_log_shape) -> dict[str, torch.Tensor]:
    """hyla's tensors -> normal-named ones; ``a_log_shape(H)`` the family's A_log shape."""
    out = {"model.embed_tokens.weight": state["embed.weight"],
           "model.norm.weight": state["norm.weight"]}
    # transformers never ties these families' head (their _tied_weights_keys is empty): a
    # tied hyla model is written with its head as a copy.
    head = state["lm_head.weight"]
    out["lm_head.weight"] = head.clone() if cfg.tie_embeddings else head
    for i, letter in enumerate(cfg.layers):
        lc, p, ours = cfg.layer_config(i), f"model.layers.{i}", f"blocks.{i}"
        out[f"{p}.input_layernorm.weight"] = state[f"{ours}.mixer_norm.weight"]
        out[f"{p}.post_attention_layernorm.weight"] = state[f"{ours}.mlp_norm.weight"]
        names = _mixer_names(letter, lc)
        if letter == "K":
            A = state[f"{ours}.mixer.A_log"]
            out[f"{p}.self_attn.A_log"] = A.reshape(a_log_shape(A.numel()))
            for c, w in zip(_CONVS, state[f"{ours}.mixer.conv.weight"].chunk(3), strict=True):
                out[f"{p}.self_attn.{c}"] = w.contiguous()
        for mine, theirs in names.items():
            out[f"{p}.self_attn.{theirs}"] = state[f"{ours}.mixer.{mine}"]
        if cfg.ffn_letter(i) == "E":
            opts = FFNS["E"].options(lc)
            out |= moe_from_hyla(state, f"{ours}.mlp", f"{p}.mlp", opts, MoENames())
        else:
            for w in ("gate_proj", "up_proj", "down_proj"):
                out[f"{p}.mlp.{w}.weight"] = state[f"{ours}.mlp.{w}.weight"]
    return out


def make_config(hf: dict, source: str, kind: str, layers: str, ffn: str, **fields
                ) -> HylaConfig:
    """The HylaConfig of one of these families (ValueError naming ``source``)."""
    heads = int(require(hf, "num_attention_heads", source, kind))
    try:
        return HylaConfig(
            vocab_size=int(require(hf, "vocab_size", source, kind)),
            d_model=int(require(hf, "hidden_size", source, kind)), layers=layers,
            n_heads=heads, ffn_dim=int(require(hf, "intermediate_size", source, kind)),
            # transformers never ties these families' lm_head to the embedding, whatever
            # tie_word_embeddings says (their _tied_weights_keys is empty): neither does hyla
            tie_embeddings=False,
            ffn_layers=ffn, family=kind,
            ffn_options={"moe": moe_options(hf, source, kind)} if "E" in ffn else {},
            **fields)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def check_exportable(cfg: HylaConfig, kind: str, mla: dict, kda: dict) -> None:
    """ValueError unless ``cfg`` is a model family ``kind`` can write: its letters, one set
    of options for every layer, and the mixers' options fixed by the family (``mla``,
    ``kda``: option -> the value the family computes)."""
    def no(what):
        raise ValueError(f"a model with {what} cannot be written as {kind}")

    if not set(cfg.layers) <= {"M", "K"}:
        no(f"layers={cfg.layers!r} (only 'M' MLA and 'K' KDA layers)")
    if not set(cfg.ffn_layers or "S") <= {"S", "E"}:
        no(f"ffn_layers={cfg.ffn_layers!r}")
    if cfg.layer_overrides and any(cfg.layer_overrides):
        no("layer_overrides (the family has one shape for every layer of a kind)")
    if cfg.norm_placement != "pre" or cfg.norm_zero_centred:
        no("post-norm blocks or zero-centred norms")
    for letter, rules in (("M", mla), ("K", kda)):
        if letter in cfg.layers:
            o = MIXERS[letter].options(cfg)
            for name, want in rules.items():
                value = getattr(o, name)
                if callable(want) and not want(value, o) or not callable(want) and value != want:
                    no(f"mixer_options[{MIXERS[letter].kind!r}].{name}={value!r}")
    if "E" in (cfg.ffn_layers or ""):
        o = FFNS["E"].options(cfg)
        if o.router != "sigmoid" or not o.score_bias or o.shared_gate \
                or o.shared_dim % o.expert_dim:
            no("an MoE other than a sigmoid router with score_bias and ungated shared experts "
               "of a multiple of expert_dim")


def config_common(cfg: HylaConfig) -> dict:
    """config.json fields both families write the same way."""
    hf = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
          "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
          "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
          "tie_word_embeddings": False, "initializer_range": cfg.initializer_range,
          "use_cache": True, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
          "layer_types": ["full_attention" if c == "M" else "linear_attention"
                          for c in cfg.layers],
          "mlp_layer_types": ["sparse" if c == "E" else "dense"
                              for c in (cfg.ffn_layers or "S" * cfg.n_layers)]}
    if "M" in cfg.layers:
        o = MIXERS["M"].options(cfg)
        hf |= {"kv_lora_rank": o.kv_lora_rank, "q_lora_rank": o.q_lora_rank,
               "qk_nope_head_dim": o.qk_nope_head_dim, "qk_rope_head_dim": o.qk_rope_head_dim,
               "v_head_dim": o.v_head_dim, "attention_bias": o.bias}
    if "E" in (cfg.ffn_layers or ""):
        o = FFNS["E"].options(cfg)
        hf |= {"num_experts": o.num_experts, "num_experts_per_token": o.top_k,
               "moe_intermediate_size": o.expert_dim,
               "num_shared_experts": o.shared_dim // o.expert_dim,
               "moe_renormalize": o.norm_topk, "routed_scaling_factor": o.scaling,
               "num_expert_group": o.n_group, "topk_group": o.topk_group}
    return hf


def rename(weights: dict, rules: list[tuple[str, str]]) -> dict:
    """Apply regex renames (in order) to every key."""
    out = {}
    for key, value in weights.items():
        for pattern, repl in rules:
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out



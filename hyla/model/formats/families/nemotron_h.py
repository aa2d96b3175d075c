"""NVIDIA Nemotron-H (``nemotron_h``): Mamba-2, attention and MLP blocks, each a block of
its own (``hybrid_override_pattern`` letters ``M``, ``*``, ``-``).

What maps onto hyla, read from transformers' ``modeling_nemotron_h.py``:

- a Nemotron-H block is ``x + mixer(norm(x))`` with one kind of mixer; hyla's block is a
  mixer then an FFN. So a Mamba (``M`` -> ``S``) or attention (``*`` -> ``A``, no rotary,
  its own ``head_dim``) block followed by an MLP block (``-``) is one hyla block with the
  ``R`` FFN (``down(relu(up(x))^2)``, ungated); a mixer block followed by another mixer is
  one with no FFN (``N``). An MLP block with no mixer before it is refused;
- the Mamba-2 layer is Granite's (``mixer_options["mamba2"]``), with its time step clamped
  below at ``time_step_min`` as transformers does, and the gated norm over ``n_groups``
  groups at ``layer_norm_epsilon``;
- the MoE blocks (``E``, Nemotron 3) and ``moe_latent_size`` are refused by name: their
  sigmoid router with expert groups and latent projections is not one of hyla's MoEs yet.

Checkpoints name the trunk ``backbone.*`` (NVIDIA's releases) or ``model.*`` (transformers);
both read.

Example:
    >>> from hyla.model.formats.families import FAMILIES
    >>> FAMILIES["nemotron_h"].architecture
    'NemotronHForCausalLM'
"""

from __future__ import annotations

import logging
import math

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
    unpermute_rows,
)
from hyla.model.mixers import MIXERS

log = logging.getLogger(__name__)

KIND = "nemotron_h"
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_TYPES = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*",
          "mlp": "-", "moe": "E"}
_REFUSED = {"mlp_hidden_act": lambda v: v == "relu2",
            "mamba_hidden_act": lambda v: v in ("silu", "swish"),
            "mlp_bias": lambda v: not v, "attention_bias": lambda v: not v,
            "moe_latent_size": lambda v: v is None, "attention_dropout": lambda v: not v}


def _pattern(hf: dict, source: str) -> str:
    """The block letters (``M * - E``) from ``layers_block_type`` or
    ``hybrid_override_pattern``."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types is None:
        pattern = require(hf, "hybrid_override_pattern", source, KIND)
        if not isinstance(pattern, str) or not set(pattern) <= set(_PATTERN):
            raise ValueError(f"{source}: hybrid_override_pattern={pattern!r} must be letters "
                             f"of {sorted(_PATTERN)}")
        return pattern
    if not isinstance(types, list) or not set(types) <= set(_TYPES):
        raise ValueError(f"{source}: layers_block_type {types!r} must be a list of "
                         f"{sorted(_TYPES)}")
    return "".join(_TYPES[t] for t in types)


def hyla_blocks(pattern: str, source: str) -> list[tuple[int, int | None]]:
    """(mixer block, its MLP block or None) of each hyla block.

    Example:
        >>> hyla_blocks("M-MM*-", "x")
        [(0, 1), (2, None), (3, None), (4, 5)]
    """
    if "E" in pattern:
        raise ValueError(f"{source}: MoE blocks ('E' in {pattern!r}, Nemotron 3) are not "
                         f"supported yet: their grouped sigmoid router is not one of hyla's")
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "-":
            raise ValueError(f"{source}: block {i} of {pattern!r} is an MLP with no Mamba or "
                             f"attention block before it, which a hyla block cannot hold")
        mlp = i + 1 if pattern[i + 1:i + 2] == "-" else None
        out.append((i, mlp))
        i += 2 if mlp is not None else 1
    return out


def to_config(hf: dict, source: str) -> HylaConfig:
    refuse(hf, source, _REFUSED)
    pattern = _pattern(hf, source)
    blocks = hyla_blocks(pattern, source)
    d = int(require(hf, "hidden_size", source, KIND))
    heads = int(require(hf, "num_attention_heads", source, KIND))
    eps = float(hf.get("layer_norm_epsilon", 1e-5))
    m_heads = int(require(hf, "mamba_num_heads", source, KIND))
    if m_heads < 1:
        raise ValueError(f"{source}: mamba_num_heads={m_heads} must be >= 1")
    step_min = hf.get("time_step_min", 0.001)
    if not (isinstance(step_min, int | float) and 0 <= step_min < math.inf):
        raise ValueError(f"{source}: time_step_min={step_min!r} must be a number >= 0")
    mamba = {"n_heads": m_heads, "head_dim": int(require(hf, "mamba_head_dim", source, KIND)),
             "state_size": int(require(hf, "ssm_state_size", source, KIND)),
             "n_groups": int(hf.get("n_groups", 8)), "conv_kernel": int(hf.get("conv_kernel", 4)),
             "conv_bias": bool(hf.get("use_conv_bias", True)),
             "proj_bias": bool(hf.get("use_bias", False)),
             # transformers' layer clamps dt to (time_step_min, inf), whatever
             # time_step_limit says
             "time_step_limit": (float(step_min), math.inf), "norm_eps": eps}
    try:
        return HylaConfig(
            vocab_size=int(require(hf, "vocab_size", source, KIND)), d_model=d,
            layers="".join("S" if pattern[m] == "M" else "A" for m, _ in blocks),
            ffn_layers="".join("N" if f is None else "R" for _, f in blocks),
            n_heads=heads, n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            attention_head_dim=int(hf.get("head_dim") or d // heads),
            ffn_dim=int(require(hf, "intermediate_size", source, KIND)), norm_eps=eps,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            mixer_options={"mamba2": mamba, "attention": {"rotary": False}}, family=KIND)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _names(cfg: HylaConfig, i: int, mixer: int, mlp: int | None) -> dict[str, str]:
    """hyla block ``i`` suffix -> transformers name after ``model.layers.``."""
    names = {"mixer_norm.weight": f"{mixer}.norm.weight"}
    if cfg.layers[i] == "S":
        opts = MIXERS["S"].options(cfg.layer_config(i))
        names |= {f"mixer.{p}": f"{mixer}.mixer.{p}" for p in ("A_log", "D", "dt_bias")}
        names |= {"mixer.norm_weight": f"{mixer}.mixer.norm.weight",
                  "mixer.conv.weight": f"{mixer}.mixer.conv1d.weight",
                  "mixer.in_proj.weight": f"{mixer}.mixer.in_proj.weight",
                  "mixer.out_proj.weight": f"{mixer}.mixer.out_proj.weight"}
        if opts.conv_bias:
            names["mixer.conv.bias"] = f"{mixer}.mixer.conv1d.bias"
        if opts.proj_bias:
            names |= {"mixer.in_proj.bias": f"{mixer}.mixer.in_proj.bias",
                      "mixer.out_proj.bias": f"{mixer}.mixer.out_proj.bias"}
    else:
        names |= {f"mixer.{p}.weight": f"{mixer}.mixer.{p}.weight"
                  for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    if mlp is not None:
        names |= {"mlp_norm.weight": f"{mlp}.norm.weight",
                  "mlp.up_proj.weight": f"{mlp}.mixer.up_proj.weight",
                  "mlp.down_proj.weight": f"{mlp}.mixer.down_proj.weight"}
    return names


def _blocks_of(cfg: HylaConfig) -> list[tuple[int, int | None]]:
    """Nemotron-H block indices of each hyla block (the inverse of :func:`hyla_blocks`)."""
    out, j = [], 0
    for letter in cfg.ffn_layers or "R" * cfg.n_layers:
        out.append((j, j + 1 if letter == "R" else None))
        j += 2 if letter == "R" else 1
    return out


def to_state(weights: dict, cfg: HylaConfig, source: str) -> dict:
    weights = {("model." + k.removeprefix("backbone.") if k.startswith("backbone.") else k): v
               for k, v in weights.items()}
    mtp = [k for k in weights if k.startswith("mtp.")]
    if mtp:
        log.info("%s: dropping %d multi-token-prediction tensors (mtp.*)", source, len(mtp))
        for k in mtp:
            del weights[k]
    for ours, theirs in (("embed_tokens", "embeddings"), ("norm", "norm_f")):
        if f"model.{theirs}.weight" in weights:
            weights[f"model.{ours}.weight"] = weights.pop(f"model.{theirs}.weight")
    out = head_to_hyla(weights, cfg, source)
    for i, (mixer, mlp) in enumerate(_blocks_of(cfg)):
        for ours, theirs in _names(cfg, i, mixer, mlp).items():
            out[f"blocks.{i}.{ours}"] = take(weights, f"model.layers.{theirs}", source)
    check_all_taken(weights, source)
    return out


def from_state(state: dict, cfg: HylaConfig) -> dict:
    out = head_from_hyla(state, cfg)
    out["model.embeddings.weight"] = out.pop("model.embed_tokens.weight")
    out["model.norm_f.weight"] = out.pop("model.norm.weight")
    for i, (mixer, mlp) in enumerate(_blocks_of(cfg)):
        for ours, theirs in _names(cfg, i, mixer, mlp).items():
            out[f"model.layers.{theirs}"] = state[f"blocks.{i}.{ours}"]
    return out


def from_config(cfg: HylaConfig) -> dict:
    """Nemotron-H's config.json; ValueError naming what ``cfg`` has that it cannot hold."""
    ffn = cfg.ffn_layers or "S" * cfg.n_layers
    if not set(cfg.layers) <= {"A", "S"} or not set(ffn) <= {"R", "N"} \
            or cfg.layer_overrides:
        raise ValueError(f"{KIND} export needs 'S' and 'A' layers with 'R' or 'N' FFNs of "
                         f"one shape each, got layers {cfg.layers!r}, FFNs {ffn!r}")
    m = MIXERS["S"].options(cfg)
    att = MIXERS["A"].options(cfg)
    if att.rotary or att.output_gate or att.sinks or att.softmax_scale or cfg.qk_norm \
            or cfg.sliding_window is not None or cfg.attention_bias or not m.gated_norm \
            or m.norm_eps not in (None, cfg.norm_eps) or m.time_step_limit[1] != math.inf \
            or cfg.embedding_scale != 1 or cfg.residual_scale != 1 or cfg.logit_scale != 1:
        raise ValueError(f"{KIND} export: a layer option Nemotron-H does not have (rotary, "
                         f"gates, sinks, scales, a window or an upper time-step limit)")
    types = []
    for letter, f in zip(cfg.layers, ffn, strict=True):
        types += ["mamba" if letter == "S" else "attention"] + (["mlp"] if f == "R" else [])
    mixer = MIXERS["S"](cfg) if "S" in cfg.layers else None
    return {"architectures": ["NemotronHForCausalLM"], "model_type": KIND,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
            "layers_block_type": types, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.ffn_dim, "mlp_hidden_act": "relu2", "mlp_bias": False,
            "attention_bias": False, "attention_dropout": 0.0,
            "layer_norm_epsilon": cfg.norm_eps, "mamba_num_heads": mixer.heads if mixer else 1,
            "mamba_head_dim": m.head_dim, "ssm_state_size": m.state_size,
            "n_groups": m.n_groups, "conv_kernel": m.conv_kernel,
            "use_conv_bias": m.conv_bias, "use_bias": m.proj_bias,
            "mamba_hidden_act": "silu", "time_step_min": m.time_step_limit[0],
            "expand": max(1, mixer.inner // cfg.d_model) if mixer else 2,
            "tie_word_embeddings": cfg.tie_embeddings, "num_nextn_predict_layers": 0,
            "initializer_range": cfg.initializer_range, "use_cache": True,
            "max_position_embeddings": 131072, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "torch_dtype": "float32", "dtype": "float32"}


# GGUF block tensor -> transformers name after "model.layers.{i}." (llama.cpp's nemotron_h)
_GGUF_BLOCK = {"attn_norm": "norm", "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj",
               "attn_v": "mixer.v_proj", "attn_output": "mixer.o_proj",
               "ssm_in": "mixer.in_proj", "ssm_out": "mixer.out_proj",
               "ssm_conv1d": "mixer.conv1d", "ssm_norm": "mixer.norm", "ssm_d": "mixer.D",
               "ssm_a": "mixer.A_log", "ssm_dt": "mixer.dt_bias", "ffn_up": "mixer.up_proj",
               "ffn_down": "mixer.down_proj"}


def gguf_config(meta: dict, shapes: dict, source: str) -> dict:
    """Nemotron-H's config.json from llama.cpp's ``nemotron_h.*`` metadata: a block with
    KV heads is attention, one with an FFN length an MLP, the rest Mamba-2."""
    arch = meta["general.architecture"]

    def get(key, default=None):
        return gguf_value(meta, arch, key, source, default)

    def per_layer(key):
        value = get(key)
        value = list(value) if isinstance(value, list) else [value] * n
        if len(value) != n:
            raise ValueError(f"{source}: {arch}.{key} {value} must give {n} blocks")
        return [int(v) for v in value]
    n = int(get("block_count"))
    kv, ff = per_layer("attention.head_count_kv"), per_layer("feed_forward_length")
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    if heads < 1 or inner % heads:
        raise ValueError(f"{source}: {arch}.ssm.inner_size={inner} must be a multiple of "
                         f"{arch}.ssm.time_step_rank (the SSM heads)={heads}")
    types = ["attention" if k else "mlp" if f else "mamba" for k, f in zip(kv, ff, strict=True)]
    first_ssm = next((i for i, t in enumerate(types) if t == "mamba"), None)
    return {"model_type": KIND, "vocab_size": gguf_shape(shapes, "token_embd.weight",
                                                       source)[0],
            "hidden_size": int(get("embedding_length")), "layers_block_type": types,
            "num_attention_heads": int(get("attention.head_count")),
            "num_key_value_heads": max(kv) or int(get("attention.head_count")),
            "head_dim": get("attention.key_length", None) or None,
            "intermediate_size": max(ff) or 1,
            "layer_norm_epsilon": get("attention.layer_norm_rms_epsilon",
                                      get("attention.layer_norm_epsilon")),
            "mamba_num_heads": heads, "mamba_head_dim": inner // heads,
            "ssm_state_size": get("ssm.state_size"), "n_groups": get("ssm.group_count"),
            "conv_kernel": get("ssm.conv_kernel"),
            "use_conv_bias": first_ssm is not None
            and f"blk.{first_ssm}.ssm_conv1d.bias" in shapes,
            "use_bias": first_ssm is not None and f"blk.{first_ssm}.ssm_in.bias" in shapes,
            # llama.cpp does not clamp dt; transformers' default floor is what it was
            # trained with
            "time_step_min": 0.001,
            "tie_word_embeddings": "output.weight" not in shapes}


def gguf_tensors(tensors: dict, hf: dict, source: str) -> dict:
    """llama.cpp's nemotron_h tensors by transformers' names: the q/k row permutation
    undone, ``A = -exp(A_log)``, D, the gated norm's groups and the 2-D convolution."""
    out = {}
    heads = {"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}
    for name, w in tensors.items():
        base, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):       # ssm_a, ssm_d have no suffix
            base, suffix = name, "weight"
        if base in ("token_embd", "output_norm", "output"):
            out[{"token_embd": "model.embeddings", "output_norm": "model.norm_f",
                 "output": "lm_head"}[base] + f".{suffix}"] = w
            continue
        parts = base.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _GGUF_BLOCK:
            raise ValueError(f"{source} has tensor {name!r}, which has no place in a "
                             f"Nemotron-H model")
        _, i, kind = parts
        if kind in heads:
            w, bare = unpermute_rows(w, heads[kind]), False
        else:
            w, bare = mamba2_gguf_tensor(kind, suffix, w)
        key = f"model.layers.{i}.{_GGUF_BLOCK[kind]}"
        out[key if bare else f"{key}.{suffix}"] = w
    return out


FAMILY = register_family(Family((KIND,), "NemotronHForCausalLM", to_config, to_state,
                                from_config, from_state,
                                GgufMapping(("nemotron_h",), gguf_config, gguf_tensors)))

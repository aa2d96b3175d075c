"""IBM Granite 4.0-H (``granitemoehybrid``): Mamba-2 layers mixed with attention, dense or
mixture-of-experts FFNs, muP-style multipliers.

What maps onto hyla, read from transformers' ``modeling_granitemoehybrid.py``:

- ``layer_types`` (``layers_block_type``): ``"mamba"`` / ``"linear_attention"`` is ``S``
  (``GraniteMoeHybridMambaLayer``: in_proj to z, x B C, dt; conv1d; the SSD with D; a gated
  RMSNorm over ``mamba_n_groups`` groups; its options in ``mixer_options["mamba2"]``);
  ``"attention"`` / ``"full_attention"`` is ``A`` with the softmax scaled by
  ``attention_multiplier`` and rotary only with ``position_embedding_type="rope"`` (NoPE
  otherwise, as Granite 4.0-H ships);
- the FFN: with ``num_local_experts`` 0, ``S`` of ``shared_intermediate_size`` (the
  ``shared_mlp``, whose fused ``input_linear`` holds gate then up); otherwise ``E``: a
  softmax over the top-k router logits, experts of ``intermediate_size`` (fused
  ``input_linear`` [E, 2I, d], ``output_linear`` [E, d, I]) and the ``shared_mlp`` as an
  ungated shared expert;
- ``embedding_multiplier``, ``residual_multiplier`` (every mixer's and FFN's output) and
  ``1 / logits_scaling`` as :class:`~hyla.model.HylaConfig`'s ``embedding_scale``,
  ``residual_scale`` and ``logit_scale``.

Example:
    >>> from hyla.model.formats.families import FAMILIES
    >>> FAMILIES["granitemoehybrid"].architecture
    'GraniteMoeHybridForCausalLM'
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
    unpermute_rows,
)
from hyla.model.layers import rope_from_hf_config
from hyla.model.mixers import MIXERS

KIND = "granitemoehybrid"
LETTERS = {"mamba": "S", "linear_attention": "S", "attention": "A", "full_attention": "A"}
_REFUSED = {"hidden_act": lambda v: v in ("silu", "swish"),
            "attention_dropout": lambda v: not v,
            "position_embedding_type": lambda v: v in (None, "rope", "nope")}
_MAMBA = ("in_proj", "conv", "out_proj")


def _int(hf: dict, key: str, default: int) -> int:
    """``hf[key]`` as an int, ``default`` only when absent or null (0 stays 0: refused later,
    by name, rather than read as the default)."""
    value = hf.get(key)
    return default if value is None else int(value)


def _positive(hf: dict, key: str, default, source: str) -> float:
    value = hf.get(key, default)
    value = default if value is None else value
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{source}: {key}={value!r} must be a positive number")
    return float(value)


def to_config(hf: dict, source: str) -> HylaConfig:
    refuse(hf, source, _REFUSED)
    n = int(require(hf, "num_hidden_layers", source, KIND))
    heads = int(require(hf, "num_attention_heads", source, KIND))
    d = int(require(hf, "hidden_size", source, KIND))
    types = list(hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * n)
    if len(types) != n or not set(types) <= set(LETTERS):
        raise ValueError(f"{source}: layer_types {types!r} must be {n} of {sorted(LETTERS)}")
    m_heads = _int(hf, "mamba_n_heads", 128)
    if m_heads < 1:
        raise ValueError(f"{source}: mamba_n_heads={m_heads} must be >= 1")
    inner = int(hf.get("mamba_expand", 2)) * d
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inner // m_heads if head_dim in (None, "auto") else int(head_dim)
    if m_heads * head_dim != inner:
        raise ValueError(f"{source}: mamba_n_heads={m_heads} x mamba_d_head={head_dim} must be "
                         f"mamba_expand x hidden_size = {inner}")
    mamba = {"n_heads": m_heads, "head_dim": head_dim,
             "state_size": _int(hf, "mamba_d_state", 256),
             "n_groups": _int(hf, "mamba_n_groups", 1),
             "conv_kernel": _int(hf, "mamba_d_conv", 4),
             "conv_bias": bool(hf.get("mamba_conv_bias", True)),
             "proj_bias": bool(hf.get("mamba_proj_bias", False)),
             "time_step_limit": time_step_limit(hf)}
    experts = int(hf.get("num_local_experts") or 0)
    shared = int(require(hf, "shared_intermediate_size", source, KIND))
    ffn_options = {}
    if experts:
        ffn_options = {"moe": {"num_experts": experts,
                               "top_k": int(require(hf, "num_experts_per_tok", source, KIND)),
                               "expert_dim": int(require(hf, "intermediate_size", source, KIND)),
                               "router": "softmax", "norm_topk": True, "shared_dim": shared}}
    rotary = hf.get("position_embedding_type") == "rope"
    theta, scaling = rope_from_hf_config(hf, source) if rotary else (10000.0, None)
    bias = bool(hf.get("attention_bias", False))
    try:
        return HylaConfig(
            vocab_size=int(require(hf, "vocab_size", source, KIND)), d_model=d,
            layers="".join(LETTERS[t] for t in types), n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads), ffn_dim=shared,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            attention_bias=bias, attention_out_bias=bias,
            ffn_layers=("E" if experts else "S") * n, ffn_options=ffn_options,
            mixer_options={"mamba2": mamba, "attention": {
                "rotary": rotary,
                "softmax_scale": _positive(hf, "attention_multiplier", 1.0, source)}},
            embedding_scale=_positive(hf, "embedding_multiplier", 1.0, source),
            residual_scale=_positive(hf, "residual_multiplier", 1.0, source),
            logit_scale=1.0 / _positive(hf, "logits_scaling", 1.0, source), family=KIND)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _layer_names(cfg: HylaConfig, i: int) -> dict[str, str]:
    """hyla block suffix -> transformers decoder-layer suffix, FFN weights apart."""
    names = {"mixer_norm.weight": "input_layernorm.weight",
             "mlp_norm.weight": "post_attention_layernorm.weight"}
    if cfg.layers[i] == "S":
        opts = MIXERS["S"].options(cfg.layer_config(i))
        names |= {f"mixer.{p}": f"mamba.{p}" for p in ("A_log", "D", "dt_bias")}
        names |= {"mixer.norm_weight": "mamba.norm.weight", "mixer.conv.weight":
                  "mamba.conv1d.weight", "mixer.in_proj.weight": "mamba.in_proj.weight",
                  "mixer.out_proj.weight": "mamba.out_proj.weight"}
        if opts.conv_bias:
            names["mixer.conv.bias"] = "mamba.conv1d.bias"
        if opts.proj_bias:
            names |= {"mixer.in_proj.bias": "mamba.in_proj.bias",
                      "mixer.out_proj.bias": "mamba.out_proj.bias"}
        return names
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"mixer.{p}.weight"] = f"self_attn.{p}.weight"
        if cfg.attention_bias:
            names[f"mixer.{p}.bias"] = f"self_attn.{p}.bias"
    return names


def _ffn_to_hyla(weights: dict, cfg: HylaConfig, i: int, source: str) -> dict:
    theirs, ours = f"model.layers.{i}", f"blocks.{i}.mlp"
    gate, up = take(weights, f"{theirs}.shared_mlp.input_linear.weight", source).chunk(2)
    down = take(weights, f"{theirs}.shared_mlp.output_linear.weight", source)
    if cfg.ffn_letter(i) == "S":
        return {f"{ours}.gate_proj.weight": gate, f"{ours}.up_proj.weight": up,
                f"{ours}.down_proj.weight": down}
    moe = f"{theirs}.block_sparse_moe"
    router = weights.pop(f"{moe}.router.weight", None)    # in memory; on disk router.layer
    return {f"{ours}.router.weight": router if router is not None
            else take(weights, f"{moe}.router.layer.weight", source),
            f"{ours}.gate_up": _either(weights, moe, "input_linear.weight",
                                       "experts.gate_up_proj", source),
            f"{ours}.down": _either(weights, moe, "output_linear.weight", "experts.down_proj",
                                    source),
            f"{ours}.shared.gate_proj.weight": gate, f"{ours}.shared.up_proj.weight": up,
            f"{ours}.shared.down_proj.weight": down}


def _either(weights: dict, prefix: str, disk: str, memory: str, source: str) -> torch.Tensor:
    """A tensor by its checkpoint name, or by transformers' in-memory name."""
    if f"{prefix}.{memory}" in weights:
        return weights.pop(f"{prefix}.{memory}")
    return take(weights, f"{prefix}.{disk}", source)


def to_state(weights: dict, cfg: HylaConfig, source: str) -> dict:
    weights = dict(weights)
    out = head_to_hyla(weights, cfg, source)
    for i in range(cfg.n_layers):
        for ours, theirs in _layer_names(cfg, i).items():
            out[f"blocks.{i}.{ours}"] = take(weights, f"model.layers.{i}.{theirs}", source)
        out |= _ffn_to_hyla(weights, cfg, i, source)
    check_all_taken(weights, source)
    return out


def from_state(state: dict, cfg: HylaConfig) -> dict:
    out = head_from_hyla(state, cfg)
    for i in range(cfg.n_layers):
        theirs, ours = f"model.layers.{i}", f"blocks.{i}.mlp"
        for o, t in _layer_names(cfg, i).items():
            out[f"{theirs}.{t}"] = state[f"blocks.{i}.{o}"]
        shared = f"{ours}.shared" if cfg.ffn_letter(i) == "E" else ours
        out[f"{theirs}.shared_mlp.input_linear.weight"] = torch.cat(
            [state[f"{shared}.gate_proj.weight"], state[f"{shared}.up_proj.weight"]])
        out[f"{theirs}.shared_mlp.output_linear.weight"] = state[f"{shared}.down_proj.weight"]
        if cfg.ffn_letter(i) == "E":
            moe = f"{theirs}.block_sparse_moe"
            out[f"{moe}.router.layer.weight"] = state[f"{ours}.router.weight"]
            out[f"{moe}.input_linear.weight"] = state[f"{ours}.gate_up"]
            out[f"{moe}.output_linear.weight"] = state[f"{ours}.down"]
    return out


def from_config(cfg: HylaConfig) -> dict:
    """Granite 4.0-H's config.json; ValueError naming what ``cfg`` has that it cannot hold."""
    if not set(cfg.layers) <= {"A", "S"} or cfg.layer_overrides:
        raise ValueError(f"{KIND} export needs 'S' and 'A' layers of one shape each, got "
                         f"{cfg.layers!r}")
    letters = set(cfg.ffn_layers or "S")
    if len(letters) != 1:
        raise ValueError(f"{KIND} export: every FFN must be dense or every one MoE, got "
                         f"{cfg.ffn_layers!r}")
    m = MIXERS["S"].options(cfg)
    att = MIXERS["A"].options(cfg)
    moe = cfg.ffn_options.get("moe", {})
    if letters == {"E"} and (moe.get("router", "softmax") != "softmax"
                             or not moe.get("norm_topk") or moe.get("shared_gate")
                             or moe.get("score_bias") or moe.get("scaling", 1.0) != 1.0
                             or moe.get("shared_dim") != cfg.ffn_dim):
        raise ValueError(f"{KIND} export: ffn_options['moe'] {moe} is not Granite's router "
                         f"(softmax over the top-k, an ungated shared expert of ffn_dim)")
    if not m.gated_norm or m.norm_eps not in (None, cfg.norm_eps) or cfg.qk_norm \
            or att.output_gate or att.sinks or cfg.sliding_window is not None:
        raise ValueError(f"{KIND} export: a layer option Granite 4.0-H does not have")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    return {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": KIND,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
            "position_embedding_type": "rope" if att.rotary else "nope",
            "attention_bias": cfg.attention_bias, "attention_dropout": 0.0,
            "attention_multiplier": att.softmax_scale or cfg.head_dim ** -0.5,
            "embedding_multiplier": cfg.embedding_scale,
            "residual_multiplier": cfg.residual_scale, "logits_scaling": 1 / cfg.logit_scale,
            "shared_intermediate_size": cfg.ffn_dim,
            "num_local_experts": moe.get("num_experts", 0) if letters == {"E"} else 0,
            "num_experts_per_tok": moe.get("top_k", 2),
            "intermediate_size": moe.get("expert_dim", cfg.ffn_dim),
            "layer_types": ["full_attention" if c == "A" else "linear_attention"
                            for c in cfg.layers],
            "mamba_n_heads": MIXERS["S"](cfg).heads if "S" in cfg.layers else 1,
            "mamba_d_head": m.head_dim, "mamba_d_state": m.state_size,
            "mamba_n_groups": m.n_groups, "mamba_d_conv": m.conv_kernel,
            "mamba_expand": (MIXERS["S"](cfg).inner // cfg.d_model) if "S" in cfg.layers
            else 2, "mamba_conv_bias": m.conv_bias, "mamba_proj_bias": m.proj_bias,
            "time_step_limit": list(m.time_step_limit), "max_position_embeddings": 131072,
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.initializer_range, "use_cache": True,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "torch_dtype": "float32", "dtype": "float32"}


# GGUF block tensor -> transformers decoder-layer suffix (llama.cpp's granitehybrid names)
_GGUF_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ssm_in": "mamba.in_proj", "ssm_out": "mamba.out_proj",
               "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm", "ssm_d": "mamba.D",
               "ssm_a": "mamba.A_log", "ssm_dt": "mamba.dt_bias",
               "ffn_gate_inp": "block_sparse_moe.router.layer",
               "ffn_down_exps": "block_sparse_moe.output_linear",
               "ffn_down_shexp": "shared_mlp.output_linear",
               "ffn_down": "shared_mlp.output_linear"}


def gguf_config(meta: dict, shapes: dict, source: str) -> dict:
    """Granite 4.0-H's config.json from llama.cpp's ``granitehybrid.*`` metadata: layers
    with KV heads are attention, the rest Mamba-2; rotary only where llama.cpp marks it
    (``rope.scaling.finetuned``); what the file does not record (the time-step limit) takes
    transformers' default."""
    arch = meta["general.architecture"]

    def get(key, default=None):
        return gguf_value(meta, arch, key, source, default)
    n = int(get("block_count"))
    kv = get("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, list) else [kv] * n
    if len(kv) != n:
        raise ValueError(f"{source}: {arch}.attention.head_count_kv {kv} must give {n} layers")
    heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    if heads < 1 or inner % heads:
        raise ValueError(f"{source}: {arch}.ssm.inner_size={inner} must be a multiple of "
                         f"{arch}.ssm.time_step_rank (the SSM heads)={heads}")
    d = int(get("embedding_length"))
    experts = int(get("expert_count", 0))
    first_ssm = next((i for i, h in enumerate(kv) if not h), None)
    first_att = next((i for i, h in enumerate(kv) if h), None)
    return {"model_type": KIND, "vocab_size": gguf_shape(shapes, "token_embd.weight",
                                                       source)[0],
            "hidden_size": d, "num_hidden_layers": n,
            "num_attention_heads": int(get("attention.head_count")),
            "num_key_value_heads": max(kv) or int(get("attention.head_count")),
            "layer_types": ["attention" if h else "mamba" for h in kv],
            "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
            "rope_theta": get("rope.freq_base", 10000.0),
            "position_embedding_type": "rope" if get("rope.scaling.finetuned", False)
            else "nope",
            "attention_multiplier": get("attention.scale", 1.0),
            "embedding_multiplier": get("embedding_scale", 1.0),
            "residual_multiplier": get("residual_scale", 1.0),
            "logits_scaling": get("logit_scale", 1.0),
            "num_local_experts": experts, "num_experts_per_tok": get("expert_used_count", 2),
            "intermediate_size": get("feed_forward_length"),
            "shared_intermediate_size": get("expert_shared_feed_forward_length",
                                            get("feed_forward_length")),
            "mamba_n_heads": heads, "mamba_d_head": inner // heads,
            "mamba_expand": inner // d if inner % d == 0 else inner / d,
            "mamba_d_state": get("ssm.state_size"), "mamba_n_groups": get("ssm.group_count"),
            "mamba_d_conv": get("ssm.conv_kernel"),
            "mamba_conv_bias": first_ssm is not None
            and f"blk.{first_ssm}.ssm_conv1d.bias" in shapes,
            "mamba_proj_bias": first_ssm is not None
            and f"blk.{first_ssm}.ssm_in.bias" in shapes,
            "attention_bias": first_att is not None and f"blk.{first_att}.attn_q.bias" in shapes,
            "tie_word_embeddings": "output.weight" not in shapes}


def gguf_tensors(tensors: dict, hf: dict, source: str) -> dict:
    """llama.cpp's granitehybrid tensors by transformers' names: its q/k row permutation
    undone, ``A = -exp(A_log)``, D and the gated norm's groups, the 2-D convolution, and the
    split gate/up halves of the experts and the shared MLP joined again."""
    out, halves = {}, {}
    heads = {"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}
    for name, w in tensors.items():
        base, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):       # ssm_a, ssm_d have no suffix
            base, suffix = name, "weight"
        if base in ("token_embd", "output_norm", "output"):
            out[{"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}[base] + f".{suffix}"] = w
            continue
        parts = base.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk":
            raise ValueError(f"{source} has tensor {name!r}, which has no place in a "
                             f"Granite 4.0-H model")
        _, i, kind = parts
        layer = f"model.layers.{i}"
        if kind in ("ffn_gate", "ffn_up", "ffn_gate_shexp", "ffn_up_shexp", "ffn_gate_exps",
                    "ffn_up_exps"):
            halves[(i, kind.removeprefix("ffn_gate").removeprefix("ffn_up"),
                    kind.startswith("ffn_gate"))] = w
            continue
        if kind not in _GGUF_BLOCK:
            raise ValueError(f"{source} has tensor {name!r}, which has no place in a "
                             f"Granite 4.0-H model")
        if kind in heads:
            w, bare = unpermute_rows(w, heads[kind]), False
        else:
            w, bare = mamba2_gguf_tensor(kind, suffix, w)
        key = f"{layer}.{_GGUF_BLOCK[kind]}"
        out[key if bare else f"{key}.{suffix}"] = w
    for (i, part, is_gate), w in halves.items():
        if not is_gate:
            continue
        up = halves.get((i, part, False))
        if up is None:
            raise ValueError(f"{source}: blk.{i}.ffn_gate{part} has no ffn_up{part}")
        where = "block_sparse_moe.input_linear" if part == "_exps" else "shared_mlp.input_linear"
        out[f"model.layers.{i}.{where}.weight"] = torch.cat([w, up], dim=-2)
    return out


FAMILY = register_family(Family((KIND,), "GraniteMoeHybridForCausalLM", to_config, to_state,
                                from_config, from_state,
                                GgufMapping(("granitehybrid",), gguf_config, gguf_tensors)))

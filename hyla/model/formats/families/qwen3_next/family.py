"""Qwen3-Next and Qwen3.5 (dense and MoE), in and out: ``qwen3_next``, ``qwen3_5_text``,
``qwen3_5_moe_text``, and the text part of the multimodal ``qwen3_5`` / ``qwen3_5_moe``.

The layers: ``layer_types`` linear_attention -> ``D`` (Gated DeltaNet with value-head
groups, :class:`~hyla.model.mixers.deltanet.DeltaOptions`), full_attention -> ``A`` with an
output gate, partial rotary and zero-centred q/k norms
(:class:`~hyla.model.mixers.attention.AttentionOptions`); FFNs ``E`` (softmax top-k router,
a sigmoid-gated shared expert) where Qwen3-Next's ``decoder_sparse_step`` /
``mlp_only_layers`` put experts (every layer in Qwen3.5-MoE), ``S`` elsewhere; block norms
zero-centred (applied as 1 + w).

Weights (:mod:`~hyla.model.formats.families.qwen3_next.tensors`): Qwen3-Next's fused
``in_proj_qkvz`` / ``in_proj_ba`` are split per key-head group and fused back on export;
experts are written one module each. Multi-token-prediction tensors (``mtp.*``) load into
:class:`hyla.model.mtp.MTPHead` (``--speculative mtp``) and export back. A multimodal
``qwen3_5`` / ``qwen3_5_moe`` directory loads its
``text_config`` and ``model.language_model.*`` tensors; its vision tower (``model.visual.*``)
is dropped with a logged warning, and the model exports as the text-only family
(``qwen3_5_text`` / ``qwen3_5_moe_text``), which ``AutoModelForCausalLM`` reads.
"""

from __future__ import annotations

import dataclasses
import logging

from hyla.model.config import HylaConfig
from hyla.model.formats.families.base import (
    Family,
    GgufMapping,
    refuse,
    register_family,
    require,
)
from hyla.model.formats.families.qwen3_next.llama_cpp import (
    MODEL_TYPES,
    gguf_config,
    gguf_tensors,
)
from hyla.model.formats.families.qwen3_next.tensors import from_state, moe_options, to_state
from hyla.model.layers import rope_from_hf_config
from hyla.model.mixers.attention import AttentionMixer
from hyla.model.mixers.deltanet import GatedDeltaMixer, delta_dims

log = logging.getLogger(__name__)

ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
NESTED = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
LAYER_TYPES = {"linear_attention": "D", "full_attention": "A"}


def to_config(hf: dict, source: str) -> HylaConfig:
    """The HylaConfig of a Qwen3-Next / Qwen3.5 config.json (or of its ``text_config``)."""
    kind = hf.get("model_type")
    if kind in NESTED:
        if hf.get("vision_config"):
            log.warning("%s: %s is multimodal: loading its text model only (the vision tower "
                        "is left out)", source, kind)
        # the outer config says whether lm_head is tied to the text model's embedding
        tie = {k: hf[k] for k in ("tie_word_embeddings",) if k in hf}
        hf, kind = dict(require(hf, "text_config", source, kind)) | tie, NESTED[kind]
        source = f"{source} (text_config)"
    need = lambda key: require(hf, key, source, kind)  # noqa: E731
    refuse(hf, source, {"hidden_act": lambda v: v == "silu",
                        "attn_output_gate": lambda v: v is True,
                        "sliding_window": lambda v: v is None,
                        "use_sliding_window": lambda v: not v,
                        "mlp_bias": lambda v: not v})
    n = need("num_hidden_layers")
    interval = hf.get("full_attention_interval", 4)     # what transformers derives without
    types = hf.get("layer_types") or [                   # layer_types (Qwen3-Next's files)
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= set(LAYER_TYPES):
        raise ValueError(f"{source}: layer_types={types!r} is not supported: expected "
                         f"{n} of {sorted(LAYER_TYPES)}")

    rope = dict(hf.get("rope_parameters") or {})
    # transformers' default for these families is 0.25 (a quarter of each head rotates)
    partial = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    for key in ("mrope_section", "mrope_interleaved"):   # text-only positions: plain RoPE
        rope.pop(key, None)
    theta, scaling = rope_from_hf_config(
        {**hf, "rope_parameters": rope, "partial_rotary_factor": None}, source)
    ffn_layers, moe = _ffn_layers(hf, kind, n, source)
    d = need("hidden_size")
    delta = {"num_k_heads": need("linear_num_key_heads"),
             "num_v_heads": need("linear_num_value_heads"),
             "head_k_dim": need("linear_key_head_dim"),
             "head_v_dim": need("linear_value_head_dim"),
             "conv_kernel": hf.get("linear_conv_kernel_dim", 4)}
    bias = bool(hf.get("attention_bias", False))
    try:
        return HylaConfig(
            vocab_size=need("vocab_size"), d_model=d, layers="".join(LAYER_TYPES[t] for t in types),
            n_heads=need("num_attention_heads"), n_kv_heads=need("num_key_value_heads"),
            ffn_dim=hf.get("intermediate_size") or moe["expert_dim"],
            attention_head_dim=need("head_dim"), attention_bias=bias, attention_out_bias=bias,
            qk_norm=True, norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            ffn_layers=ffn_layers, ffn_options={"moe": moe} if moe else {},
            mixer_options={"attention": {"output_gate": True,
                                         "partial_rotary_factor": partial},
                           "gated_delta": delta},
            norm_zero_centred=True, family=kind)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _ffn_layers(hf: dict, kind: str, n: int, source: str) -> tuple[str, dict | None]:
    """(``ffn_layers``, MoE options or None): Qwen3-Next's decoder_sparse_step and
    mlp_only_layers, every layer for Qwen3.5-MoE, none for Qwen3.5."""
    if kind == "qwen3_5_text":
        return "S" * n, None
    experts = hf.get("num_experts", 0) or 0
    if kind == "qwen3_5_moe_text":
        letters = "E" * n
    else:
        step = hf.get("decoder_sparse_step", 1)
        only = set(hf.get("mlp_only_layers") or [])
        if not isinstance(step, int) or step <= 0:
            raise ValueError(f"{source}: decoder_sparse_step={step!r} must be a positive int")
        letters = "".join("E" if experts > 0 and i not in only and (i + 1) % step == 0
                          else "S" for i in range(n))
    if "E" not in letters:
        return letters, None
    shared = require(hf, "shared_expert_intermediate_size", source, kind)
    refuse(hf, source, {"shared_expert_intermediate_size": lambda v: v > 0})
    moe = {"num_experts": experts, "top_k": require(hf, "num_experts_per_tok", source, kind),
           "expert_dim": require(hf, "moe_intermediate_size", source, kind),
           "router": "softmax", "shared_dim": shared, "shared_gate": True,
           # Qwen3.5-MoE's router always renormalises the top k
           "norm_topk": kind == "qwen3_5_moe_text" or bool(hf.get("norm_topk_prob", True))}
    return letters, moe


def from_config(cfg: HylaConfig) -> dict:
    """The family's config.json for a model loaded from (or built as) it."""
    kind = cfg.family
    letters = cfg.ffn_layers or "S" * cfg.n_layers
    if set(cfg.layers) - {"A", "D"}:
        raise ValueError(f"{kind} has only 'A' and 'D' layers: layers={cfg.layers!r}")
    if kind == "qwen3_5_text" and "E" in letters or kind == "qwen3_5_moe_text" and "S" in letters:
        raise ValueError(f"{kind}: ffn_layers={letters!r} does not fit the family "
                         f"(Qwen3.5 is dense everywhere, Qwen3.5-MoE sparse everywhere)")
    attn = AttentionMixer.options(cfg)
    delta = GatedDeltaMixer.options(cfg)
    hk, hv, dk, dv = delta_dims(cfg, delta)
    _check_exportable(cfg, attn, delta, letters)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": attn.partial_rotary_factor}
    if kind.startswith("qwen3_5"):
        # Qwen3.5's multimodal rotary sections: with text positions (the same for all three)
        # they are plain RoPE, but llama.cpp sizes its rotation by them, so they must fit
        # the rotary dims, as Qwen3.5's own [11, 11, 10] fit its 64
        rope |= {"mrope_section": rope_sections(cfg.head_dim, attn.partial_rotary_factor),
                 "mrope_interleaved": True}
    max_positions = 32768
    if cfg.rope_scaling:
        rope |= cfg.rope_scaling
        if rope["rope_type"] == "dynamic":      # transformers' length for dynamic scaling
            max_positions = rope.pop("original_max_position_embeddings")
    hf = {"architectures": [ARCHITECTURES[kind]], "model_type": kind,
          "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
          "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
          "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
          "rope_parameters": rope, "max_position_embeddings": max_positions,
          "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attention_bias,
          "attention_dropout": 0.0, "initializer_range": cfg.initializer_range,
          "layer_types": [{"A": "full_attention", "D": "linear_attention"}[c]
                          for c in cfg.layers],
          "linear_conv_kernel_dim": delta.conv_kernel, "linear_key_head_dim": dk,
          "linear_value_head_dim": dv, "linear_num_key_heads": hk,
          "linear_num_value_heads": hv, "use_cache": True,
          "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if "E" in letters:
        moe = moe_options(cfg.layer_config(letters.index("E")))
        hf |= {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
               "moe_intermediate_size": moe.expert_dim,
               "shared_expert_intermediate_size": moe.shared_dim,
               "norm_topk_prob": moe.norm_topk}
    if kind == "qwen3_next":
        hf |= {"decoder_sparse_step": 1,
               "mlp_only_layers": [i for i, c in enumerate(letters) if c == "S"]}
        if "E" not in letters:
            hf["num_experts"] = 0
    if cfg.mtp_layers:      # what vLLM and SGLang read (transformers leaves mtp.* out)
        hf["num_nextn_predict_layers" if kind == "qwen3_next" else "mtp_num_hidden_layers"] \
            = cfg.mtp_layers
    return hf


def rope_sections(head_dim: int, partial: float) -> list[int]:
    """Three rotary sections (in frequency pairs) covering a head's rotary dims.

    Example:
        >>> rope_sections(256, 0.25), rope_sections(64, 1.0), rope_sections(4, 1.0)
        ([11, 11, 10], [11, 11, 10], [2, 0, 0])
    """
    pairs = int(head_dim * partial) // 2
    if pairs < 3:
        return [pairs, 0, 0]
    each = -(-pairs // 3)
    return [each, each, pairs - 2 * each]


def _check_exportable(cfg: HylaConfig, attn, delta, letters: str) -> None:
    """ValueError naming the field when ``cfg`` computes something the family cannot."""
    want = {"layer_overrides": (cfg.layer_overrides or None, None),
            "norm_zero_centred": (cfg.norm_zero_centred, True), "qk_norm": (cfg.qk_norm, True),
            "sliding_window": (cfg.sliding_window, None),
            "attention_out_bias": (cfg.attention_out_bias, cfg.attention_bias),
            "norm_placement": (cfg.norm_placement, "pre"),
            "mixer_options['attention']": (
                (attn.output_gate, attn.rotary, attn.qk_norm_scope, attn.value_head_dim,
                 attn.value_scale, attn.sinks), (True, True, "head", None, 1.0, False)),
            "mixer_options['gated_delta']": (
                (delta.decay_rank, delta.safe_gate, delta.beta_scale, delta.gate_rank,
                 delta.gate_act, delta.o_norm_eps in (None, cfg.norm_eps)),
                (None, False, 1.0, None, "silu", True))}
    if "E" in letters:
        moe = moe_options(cfg.layer_config(letters.index("E")))
        want["ffn_options['moe']"] = (
            (moe.router, moe.scaling, moe.n_group, moe.score_bias, moe.shared_dim > 0,
             moe.shared_gate, moe.norm_topk or cfg.family != "qwen3_5_moe_text"),
            ("softmax", 1.0, 1, False, True, True, True))
    for field, (have, need) in want.items():
        if have != need:
            raise ValueError(f"{cfg.family} export: {field} is {have!r}, the family has "
                             f"{need!r}")


def student_layout(cfg: HylaConfig) -> HylaConfig:
    """``cfg`` (``A`` and ``D`` layers) in Qwen3.5's text layout: zero-centred norms, q/k
    norms per head, attention with an output gate (rotary over as much of each head as
    ``cfg`` rotates: a teacher's whole head), Gated DeltaNet with the default options
    (key and value heads of one count and size, as llama.cpp needs), no window.

    Example:
        >>> from hyla.model import preset
        >>> import dataclasses
        >>> s = student_layout(dataclasses.replace(preset("debug"), layers="DDDA"))
        >>> s.family, s.qk_norm, s.norm_zero_centred, s.mixer_options["attention"]
        ('qwen3_5_text', True, True, {'output_gate': True, 'partial_rotary_factor': 1.0})
    """
    if set(cfg.layers) - {"A", "D"} or cfg.linear_window or cfg.sliding_window is not None:
        raise ValueError(f"the Qwen3.5 layout holds 'A' and 'D' layers without windows, got "
                         f"layers {cfg.layers!r}, linear_window {cfg.linear_window}, "
                         f"sliding_window {cfg.sliding_window}")
    attn = {"output_gate": True,
            "partial_rotary_factor": AttentionMixer.options(cfg).partial_rotary_factor}
    return dataclasses.replace(cfg, qk_norm=True, norm_zero_centred=True,
                               mixer_options={"attention": attn}, family="qwen3_5_text")


_GGUF = GgufMapping(tuple(MODEL_TYPES), gguf_config, gguf_tensors)
for _kind in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"):
    register_family(Family((_kind,), ARCHITECTURES[NESTED.get(_kind, _kind)], to_config,
                           to_state, from_config, from_state,
                           _GGUF if _kind in MODEL_TYPES.values() else None,
                           layout=student_layout if _kind == "qwen3_5_text" else None))

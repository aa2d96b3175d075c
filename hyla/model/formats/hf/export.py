"""Writing a hyla model as a transformers directory: an all-attention model as the family its
features need (Llama, Mistral, Qwen2, Qwen3), a hybrid family's model in that family's own
format; ``transformers`` loads either and gives the same logits."""

from __future__ import annotations

import json
import os
import pathlib

from safetensors.torch import save_file

from hyla.model.config import HylaConfig
from hyla.model.formats.families import FAMILIES
from hyla.model.formats.hf.config import ARCHITECTURES, EXPORT_FORMATS
from hyla.model.formats.hf.tokenizer import save_hf_tokenizer
from hyla.model.formats.hf.weights import layer_map
from hyla.model.model import HylaLM


def export_family(cfg: HylaConfig) -> str:
    """The transformers family an all-attention config exports as: Llama unless it needs
    another (q/k norm: Qwen3; q/k/v biases without an o bias: Qwen2; a window without biases:
    Mistral); ValueError naming the field when none has its features."""
    if cfg.qk_norm:
        if cfg.attention_bias != cfg.attention_out_bias:
            raise ValueError("qk_norm with attention_bias != attention_out_bias has no "
                             "transformers family (Qwen3 has both biases or neither)")
        return "qwen3"
    if cfg.attention_bias and not cfg.attention_out_bias:
        return "qwen2"
    if cfg.attention_out_bias and not cfg.attention_bias:
        raise ValueError("attention_out_bias without attention_bias has no transformers family")
    if cfg.sliding_window is not None:
        if cfg.attention_bias:
            raise ValueError("sliding_window with attention biases on q, k, v and o has no "
                             "transformers family (Llama has no window, Mistral no biases)")
        return "mistral"
    return "llama"


def _check_plain_attention(cfg: HylaConfig, fmt: str) -> None:
    """ValueError naming the field when ``cfg`` has what Llama, Mistral and Qwen cannot hold
    (their export would silently compute something else)."""
    if cfg.family is not None:
        raise ValueError(f"this model is a {cfg.family!r} model: export it with "
                         f"--format transformers (its own format), not {fmt}")
    plain = {"ffn_layers": (None, "S" * cfg.n_layers), "mixer_options": ({},),
             "ffn_options": ({},), "layer_overrides": (None,), "norm_zero_centred": (False,),
             "norm_placement": ("pre",)}
    for name, allowed in plain.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name}={getattr(cfg, name)!r} has no Llama / Mistral / Qwen "
                             f"equivalent: this model cannot be exported as {fmt}")


def hyla_to_hf_config(cfg: HylaConfig, max_positions: int = 32768) -> dict:
    """The transformers config.json of an all-attention hyla config (:func:`export_family`)."""
    kind = export_family(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
        if rope["rope_type"] == "dynamic":      # transformers' length for dynamic scaling
            max_positions = rope.pop("original_max_position_embeddings")
    hf = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": rope,
        "max_position_embeddings": max_positions, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_out_bias, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": cfg.initializer_range, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "torch_dtype": "float32", "dtype": "float32",
    }
    if kind == "mistral":
        hf["sliding_window"] = cfg.sliding_window
    elif kind in ("qwen2", "qwen3"):
        slide = cfg.sliding_window is not None
        hf |= {"use_sliding_window": slide, "sliding_window": cfg.sliding_window,
               "max_window_layers": 0 if slide else cfg.n_layers,
               "layer_types": [("sliding_attention" if slide else "full_attention")] * cfg.n_layers}
    return hf


def export_hf(model: HylaLM, tokenizer, out_dir: str | os.PathLike, *,
              fmt: str = "llama") -> pathlib.Path:
    """Write an all-attention hyla model as a transformers directory (``LlamaForCausalLM``,
    or the family :func:`export_family` picks for its attention features).

    Example:
        >>> import tempfile, dataclasses
        >>> from hyla.model import preset
        >>> from hyla.data import ByteTokenizer
        >>> m = HylaLM(dataclasses.replace(preset("debug"), layers="AA"))
        >>> d = export_hf(m, ByteTokenizer(), tempfile.mkdtemp())
        >>> sorted(p.name for p in d.iterdir())[:2]
        ['config.json', 'model.safetensors']
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    cfg = model.cfg
    family = FAMILIES.get(cfg.family) if fmt == "transformers" else None
    if family is not None:
        return _export_family(model, tokenizer, out_dir, family)
    _check_plain_attention(cfg, fmt)
    if set(cfg.layers) != {"A"}:
        raise ValueError(f"only a model whose layers are all 'A' exports to {fmt}: this one has "
                         f"layers={cfg.layers!r} (GLA layers have no transformers equivalent)")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    state = {"model.embed_tokens.weight": sd["embed.weight"],
             "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layers):
        for ours, theirs in layer_map(cfg).items():
            state[f"model.layers.{i}.{theirs}"] = sd[f"blocks.{i}.{ours}"]
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = hyla_to_hf_config(cfg)
    hf_cfg |= save_hf_tokenizer(tokenizer, out)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n", encoding="utf-8")
    return out


def _export_family(model: HylaLM, tokenizer, out_dir, family) -> pathlib.Path:
    """Write a model loaded from (or built as) a hybrid family in that family's format, its
    tensors as they are (a loaded model round-trips bit for bit)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = family.from_state({k: v.detach().contiguous() for k, v in
                               model.state_dict().items()}, model.cfg)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = family.from_config(model.cfg)
    hf_cfg |= save_hf_tokenizer(tokenizer, out)
    hf_cfg |= model.cfg.hf_extras           # the source's own values win over defaults
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n", encoding="utf-8")
    return out

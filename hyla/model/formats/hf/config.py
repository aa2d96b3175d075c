"""Hugging Face ``transformers`` interop: load Llama / Mistral / Qwen2 / Qwen3 directories,
export all-attention models as the family they need.

A supported directory holds ``config.json``, safetensors weights (``model.safetensors`` or a
sharded ``model.safetensors.index.json``) and ``tokenizer.json``. Reading needs neither
``transformers`` nor any pickle: the config is JSON and the weights are safetensors.

What maps onto hyla (:class:`~hyla.model.HylaConfig`'s attention fields), and what is refused
(``ValueError`` naming the file and the field):

- grouped-query attention with rotary embeddings: hyla's ``apply_rotary`` uses the same
  half-split (``rotate_half``) layout and the same frequencies as transformers, so q/k rows
  port without any permutation. Scaled RoPE ``linear``, ``dynamic``, ``llama3`` and ``yarn``
  use transformers' formulas; other ``rope_type`` values and ``partial_rotary_factor`` are
  refused. An explicit ``head_dim`` is kept;
- attention biases: Qwen2's q/k/v biases, Llama's and Qwen3's ``attention_bias`` (q, k, v
  and o); Qwen3's q/k RMSNorm;
- sliding windows: Mistral's ``sliding_window``, Qwen2/Qwen3's ``use_sliding_window`` when
  every layer slides (``layer_types`` mixing full and sliding layers is refused);
- SwiGLU MLP (``hidden_act`` silu, no MLP bias), RMSNorm with the file's ``rms_norm_eps``
  (hyla uses one eps for every norm), tied or untied embeddings;
- every tensor of the file must have its place: one the config does not declare (a bias
  with ``attention_bias: false``) is refused rather than dropped.

Export writes a transformers directory (fp32 safetensors, ``config.json``, the tokenizer as
``tokenizer.json`` + ``tokenizer_config.json``) from a hyla model whose layers are all ``A``:
``LlamaForCausalLM``, or Qwen3 / Qwen2 / Mistral when its q/k norms, biases or window need
them (:func:`export_family`); ``transformers`` loads it and gives the same logits.
"""

from __future__ import annotations

import json
import os
import pathlib

from hyla.model.config import HylaConfig
from hyla.model.layers import rope_from_hf_config

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


EXPORT_FORMATS = ("transformers", "llama")
# config.json fields a family model keeps from its source and writes back on export.


HF_EXTRAS = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def is_hf_directory(path: str | os.PathLike) -> bool:
    """True when ``path/config.json`` is a transformers config (it names a ``model_type``)."""
    cfg = pathlib.Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "model_type" in json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def count_field(hf: dict, key: str, source: str, kind: str) -> int:
    """``hf[key]`` as a count (an int >= 1; 4096.0 taken as 4096), or a ValueError naming
    the file and the field (not ``int()``'s "invalid literal ... 'big'").

    Example:
        >>> count_field({"hidden_size": "big"}, "hidden_size", "m/config.json", "llama")
        Traceback (most recent call last):
        ...
        ValueError: m/config.json: hidden_size must be an int >= 1, got 'big'
    """
    if key not in hf:
        raise ValueError(f"{source} has no {key!r}: expected a complete {kind} config")
    value = hf[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{source}: {key} must be an int >= 1, got {value!r}")
    return value


def hf_config_to_hyla(hf: dict, source: str = "config.json") -> HylaConfig:
    """Translate a transformers config dict into an all-attention :class:`HylaConfig`.

    Example:
        >>> cfg = hf_config_to_hyla({"model_type": "llama", "vocab_size": 300,
        ...     "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        ...     "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5})
        >>> cfg.layers, cfg.n_kv_heads, cfg.norm_eps, cfg.rope_theta
        ('AA', 2, 1e-05, 10000.0)
    """
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(f"{source}: model_type {kind!r} is not supported: expected one of "
                         f"{sorted(ARCHITECTURES)} (standard GQA attention, rotary, SwiGLU, "
                         f"RMSNorm)")
    d, heads, n_layers, ffn, vocab = (
        count_field(hf, key, source, kind) for key in (
            "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
            "vocab_size"))
    kv = count_field(hf, "num_key_value_heads", source, kind) if hf.get(
        "num_key_value_heads") is not None else heads
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{source}: hidden_act {act!r} is not supported: expected 'silu' "
                         f"(SwiGLU)")
    if hf.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported: hyla's SwiGLU has no bias")
    head_dim = count_field(hf, "head_dim", source, kind) if hf.get("head_dim") else d // heads
    theta, scaling = rope_from_hf_config(hf, source)
    bias = bool(hf.get("attention_bias", False))
    return HylaConfig(vocab_size=vocab, d_model=d, layers="A" * n_layers, n_heads=heads,
                      n_kv_heads=kv, ffn_dim=ffn, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                      rope_theta=theta, rope_scaling=scaling,
                      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                      attention_head_dim=None if head_dim * heads == d else head_dim,
                      attention_bias=kind == "qwen2" or (kind != "mistral" and bias),
                      attention_out_bias=kind in ("llama", "qwen3") and bias,
                      qk_norm=kind == "qwen3", sliding_window=_window(hf, kind, n_layers, source))


def _window(hf: dict, kind: str, n_layers: int, source: str) -> int | None:
    """The one sliding window of every layer, or None; mixed full/sliding layers refused."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is None:
        if kind == "mistral":
            types = ["sliding_attention" if window is not None else "full_attention"] * n_layers
        elif kind in ("qwen2", "qwen3"):
            slide = hf.get("use_sliding_window") and window is not None
            first = int(hf.get("max_window_layers") or 0)
            types = ["sliding_attention" if slide and i >= first else "full_attention"
                     for i in range(n_layers)]
        else:
            types = ["full_attention"] * n_layers
    kinds = set(types)
    if not kinds <= {"full_attention", "sliding_attention"} or len(types) != n_layers:
        raise ValueError(f"{source}: layer_types {types!r} is not supported: expected "
                         f"{n_layers} of 'full_attention' / 'sliding_attention'")
    if kinds == {"full_attention", "sliding_attention"}:
        raise ValueError(f"{source}: layer_types mixes full and sliding-window attention "
                         f"(use_sliding_window / max_window_layers): hyla has one window for "
                         f"every attention layer")
    if kinds == {"sliding_attention"}:
        if not isinstance(window, int) or window <= 0:
            raise ValueError(f"{source}: sliding_window {window!r} must be a positive int")
        return window
    return None

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

import dataclasses
import json
import os
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hyla.model.config import HylaConfig
from hyla.model.formats.hf_tokenizer import load_hf_tokenizer, save_hf_tokenizer
from hyla.model.layers import check_rope_scaling
from hyla.model.model import HylaLM

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
EXPORT_FORMATS = ("transformers", "llama")
# config.json fields a family model keeps from its source and writes back on export.
HF_EXTRAS = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")

_LAYER_MAP = {  # hyla block suffix -> transformers decoder-layer suffix
    "mixer_norm.weight": "input_layernorm.weight",
    "mixer.q_proj.weight": "self_attn.q_proj.weight",
    "mixer.k_proj.weight": "self_attn.k_proj.weight",
    "mixer.v_proj.weight": "self_attn.v_proj.weight",
    "mixer.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def is_hf_directory(path: str | os.PathLike) -> bool:
    """True when ``path/config.json`` is a transformers config (it names a ``model_type``)."""
    cfg = pathlib.Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "model_type" in json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


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
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        n_layers, ffn = int(hf["num_hidden_layers"]), int(hf["intermediate_size"])
        vocab = int(hf["vocab_size"])
    except KeyError as e:
        raise ValueError(f"{source} has no {e.args[0]!r}: expected a complete {kind} "
                         f"config") from None
    kv = int(hf.get("num_key_value_heads") or heads)
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{source}: hidden_act {act!r} is not supported: expected 'silu' "
                         f"(SwiGLU)")
    if hf.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported: hyla's SwiGLU has no bias")
    head_dim = int(hf.get("head_dim") or d // heads)
    theta, scaling = _rope(hf, source)
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


def _rope(hf: dict, source: str) -> tuple[float, dict | None]:
    """(rope_theta, hyla rope_scaling) from ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` + ``rope_theta`` (older files)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if params and not isinstance(params.get("rope_type", params.get("type", "")), str):
        raise ValueError(f"{source}: rope_parameters per layer type are not supported")
    kind = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor {partial} is not supported: hyla "
                         f"rotates the whole head")
    if kind == "default":
        return theta, None
    if kind in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = hf.get(
            "original_max_position_embeddings",
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings")))
    if kind == "yarn" and params.get("factor") is None and hf.get("max_position_embeddings"):
        params["factor"] = hf["max_position_embeddings"] / params[
            "original_max_position_embeddings"]
    if kind == "dynamic":      # transformers rescales beyond max_position_embeddings
        params["original_max_position_embeddings"] = hf.get("max_position_embeddings")
    scaling = {"rope_type": kind, **params}
    try:
        check_rope_scaling(scaling, f"{source}: rope_parameters")
    except ValueError as e:
        raise ValueError(str(e)) from None
    return theta, scaling


def _read_weights(root: pathlib.Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                               .values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a safetensors index: {e}") from e
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        others = sorted(p.name for p in root.glob("*.bin")) + sorted(
            p.name for p in root.glob("*.pt"))
        hint = f" (found {others[:3]}: pickled weights are not loaded)" if others else ""
        raise ValueError(f"{root} has no model.safetensors or model.safetensors.index.json"
                         f"{hint}: expected safetensors weights")
    weights = {}
    for name in files:
        try:
            with safe_open(str(root / name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    weights[key] = f.get_tensor(key).to(dtype)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"{root / name} could not be read as safetensors: {e}") from e
    return weights


def hf_state_to_hyla(weights: dict[str, torch.Tensor], cfg: HylaConfig,
                     source: str = "model.safetensors") -> dict[str, torch.Tensor]:
    """Rename a transformers state dict to hyla's. Every tensor of the file must have a
    place in ``cfg``'s model: one that would be dropped (a bias the config does not declare,
    say) is refused, since the model would then compute something else."""
    from hyla.model.formats.families.base import head_to_hyla  # that module imports this

    weights = dict(weights)
    out = head_to_hyla(weights, cfg, source)
    for i in range(cfg.n_layers):
        for ours, theirs in _layer_map(cfg).items():
            out[f"blocks.{i}.{ours}"] = _take(weights, f"model.layers.{i}.{theirs}", source)
    left = sorted(k for k in weights if not k.endswith("rotary_emb.inv_freq"))
    if left:
        raise ValueError(f"{source} has tensors the config does not account for: {left[:4]} "
                         f"(a bias or norm config.json does not declare): refused, since "
                         f"dropping them would change the model")
    return out


def _layer_map(cfg: HylaConfig) -> dict[str, str]:
    """hyla block suffix -> transformers decoder-layer suffix, for the tensors ``cfg`` has."""
    layer_map = dict(_LAYER_MAP)
    if cfg.attention_bias:
        layer_map |= {f"mixer.{p}.bias": f"self_attn.{p}.bias"
                      for p in ("q_proj", "k_proj", "v_proj")}
    if cfg.attention_out_bias:
        layer_map["mixer.o_proj.bias"] = "self_attn.o_proj.bias"
    if cfg.qk_norm:
        layer_map |= {"mixer.q_norm.weight": "self_attn.q_norm.weight",
                      "mixer.k_norm.weight": "self_attn.k_norm.weight"}
    return layer_map


def _take(weights: dict, key: str, source: str) -> torch.Tensor:
    if key not in weights:
        raise ValueError(f"{source} has no tensor {key!r}: expected a Llama-style state dict")
    return weights.pop(key)


def load_hf(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
            device: str | torch.device = "cpu"):
    """Load a transformers causal-LM directory as (all-attention HylaLM in eval mode, tokenizer).

    Example:
        >>> import tempfile, tokenizers, transformers
        >>> path = tempfile.mkdtemp()
        >>> transformers.LlamaForCausalLM(transformers.LlamaConfig(
        ...     vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)
        >>> words = tokenizers.models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")
        >>> tokenizers.Tokenizer(words).save(f"{path}/tokenizer.json")
        >>> model, tok = load_hf(path)
        >>> model.cfg.layers, model.cfg.vocab_size, tok.encode("hi")
        ('AA', 64, [1])
    """
    root = pathlib.Path(path)
    if not (root / "config.json").is_file():
        raise ValueError(f"{root} has no config.json: expected a transformers model directory")
    source = str(root / "config.json")
    try:
        hf = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from e
    from hyla.model.formats.families import FAMILIES  # the families import this module

    family = FAMILIES.get(hf.get("model_type")) if isinstance(hf, dict) else None
    if family is not None:
        cfg = family.to_config(hf, source)
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
        kept = {k: text.get(k, hf.get(k)) for k in HF_EXTRAS}
        cfg = dataclasses.replace(cfg, hf_extras={k: v for k, v in kept.items()
                                                  if v is not None})
        state = family.to_state(_read_weights(root, dtype), cfg, str(root / "model.safetensors"))
    else:
        cfg = hf_config_to_hyla(hf, source)
        state = hf_state_to_hyla(_read_weights(root, dtype), cfg,
                                 str(root / "model.safetensors"))
    return hyla_model_from(cfg, state, str(root), source, dtype=dtype, device=device), \
        load_hf_tokenizer(root, cfg.vocab_size)


def hyla_model_from(cfg: HylaConfig, state: dict[str, torch.Tensor], where: str, source: str,
                    *, dtype: torch.dtype, device, assign: bool = False) -> HylaLM:
    """A HylaLM of ``cfg`` (eval mode) holding ``state`` (hyla names), every shape checked
    against the config on the meta device before any memory is allocated. ``assign``: the
    model takes ``state``'s own tensors (contiguous, ``dtype``, on ``device``, used nowhere
    else) rather than copies of them."""
    from hyla.model.formats.skeleton import meta_model, to_empty

    model = meta_model(cfg)     # no init on meta: it would import torch._dynamo (seconds)
    want = model.state_dict()
    unknown = sorted(set(state) - set(want))
    if unknown:
        raise ValueError(f"{where}: tensors {unknown[:4]} have no place in the model {source} "
                         f"describes")
    for key, tensor in state.items():
        param = want[key]
        if param.shape != tensor.shape:
            raise ValueError(f"{where}: tensor for {key} has shape {tuple(tensor.shape)}, "
                             f"{source} implies {tuple(param.shape)}")
    model = to_empty(model, device).to(dtype)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.load_state_dict(state, strict=not cfg.tie_embeddings, assign=assign)
    if cfg.tie_embeddings and assign:
        model.lm_head.weight = model.embed.weight
    return model.eval()


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
    from hyla.model.formats.families import FAMILIES

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
        for ours, theirs in _layer_map(cfg).items():
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

"""Hugging Face ``transformers`` interop: load Llama / Mistral / Qwen2 directories, export Llama.

A supported directory holds ``config.json``, safetensors weights (``model.safetensors`` or a
sharded ``model.safetensors.index.json``) and ``tokenizer.json``. Reading needs neither
``transformers`` nor any pickle: the config is JSON and the weights are safetensors.

What maps onto hyla, and what is refused (``ValueError`` naming the file and the field):

- grouped-query attention with rotary embeddings: hyla's ``apply_rotary`` uses the same
  half-split (``rotate_half``) layout and the same frequencies ``theta ** (-2i / D)`` as
  transformers' default RoPE, so q/k rows port without any permutation. Scaled RoPE variants
  (``rope_type`` other than ``"default"``), a ``head_dim`` other than ``hidden_size /
  num_attention_heads`` and sliding-window attention are refused;
- SwiGLU MLP (``hidden_act`` silu, no MLP bias), RMSNorm with the file's ``rms_norm_eps``
  (hyla uses one eps for every norm), tied or untied embeddings;
- attention biases: hyla's attention layer has none. Qwen2 always declares q/k/v biases;
  they load when they are all zero (as a freshly initialised model's are) and are refused
  otherwise, since dropping them would change the model. Llama/Mistral ``attention_bias``
  likewise.

Export writes a ``LlamaForCausalLM`` directory (fp32 safetensors, ``config.json``, the
tokenizer as ``tokenizer.json`` + ``tokenizer_config.json``) from a hyla model whose layers
are all ``A``; ``transformers`` loads it and gives the same logits.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hyla.model.config import HylaConfig
from hyla.model.formats.hf_tokenizer import load_hf_tokenizer, save_hf_tokenizer
from hyla.model.model import HylaLM

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
EXPORT_FORMATS = ("llama",)

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
_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


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
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != d:
        raise ValueError(f"{source}: head_dim {head_dim} is not supported: hyla needs "
                         f"head_dim = hidden_size / num_attention_heads = {d // heads}")
    if hf.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported: hyla's SwiGLU has no bias")
    if hf.get("sliding_window") is not None and (kind != "qwen2" or hf.get("use_sliding_window")):
        raise ValueError(f"{source}: sliding_window={hf['sliding_window']} is not supported: "
                         f"hyla's attention is full causal (set it to null if your sequences "
                         f"are no longer than the window)")
    return HylaConfig(vocab_size=vocab, d_model=d, layers="A" * n_layers, n_heads=heads,
                      n_kv_heads=kv, ffn_dim=ffn, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                      rope_theta=_rope_theta(hf, source),
                      tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _rope_theta(hf: dict, source: str) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{source}: rope_type {rope_type!r} is not supported: expected "
                         f"'default' (plain RoPE, no scaling)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


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
    """Rename a transformers state dict to hyla's (checking shapes and refusing non-zero
    attention biases)."""
    out = {"embed.weight": _take(weights, "model.embed_tokens.weight", source),
           "norm.weight": _take(weights, "model.norm.weight", source)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = _take(weights, "lm_head.weight", source)
    for i in range(cfg.n_layers):
        for ours, theirs in _LAYER_MAP.items():
            out[f"blocks.{i}.{ours}"] = _take(weights, f"model.layers.{i}.{theirs}", source)
        for bias in _BIASES:
            b = weights.get(f"model.layers.{i}.{bias}")
            if b is not None and bool(b.abs().max() > 0):
                raise ValueError(f"{source}: model.layers.{i}.{bias} is non-zero: hyla's "
                                 f"attention layers have no q/k/v bias, so this model cannot "
                                 f"be converted exactly")
    return out


def _take(weights: dict, key: str, source: str) -> torch.Tensor:
    if key not in weights:
        raise ValueError(f"{source} has no tensor {key!r}: expected a Llama-style state dict")
    return weights[key]


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
    cfg = hf_config_to_hyla(hf, source)
    state = hf_state_to_hyla(_read_weights(root, dtype), cfg, str(root / "model.safetensors"))
    with torch.device("meta"):
        model = HylaLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    for key, tensor in state.items():
        param = model.get_parameter(key)
        if param.shape != tensor.shape:
            raise ValueError(f"{root}: tensor for {key} has shape {tuple(tensor.shape)}, "
                             f"{source} implies {tuple(param.shape)}")
    model.load_state_dict(state, strict=not cfg.tie_embeddings)
    tokenizer = load_hf_tokenizer(root, cfg.vocab_size)
    return model.eval(), tokenizer


def hyla_to_hf_config(cfg: HylaConfig, max_positions: int = 32768) -> dict:
    """The ``LlamaForCausalLM`` config.json of an all-attention hyla config."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": max_positions, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": cfg.initializer_range, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "torch_dtype": "float32", "dtype": "float32",
    }


def export_hf(model: HylaLM, tokenizer, out_dir: str | os.PathLike, *,
              fmt: str = "llama") -> pathlib.Path:
    """Write an all-attention hyla model as a transformers ``LlamaForCausalLM`` directory.

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
        for ours, theirs in _LAYER_MAP.items():
            state[f"model.layers.{i}.{theirs}"] = sd[f"blocks.{i}.{ours}"]
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = hyla_to_hf_config(cfg)
    hf_cfg |= save_hf_tokenizer(tokenizer, out)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n", encoding="utf-8")
    return out


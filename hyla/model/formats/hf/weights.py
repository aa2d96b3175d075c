"""A transformers directory's safetensors weights, and their names mapped onto hyla's for the
all-attention families (Llama, Mistral, Qwen2, Qwen3; the hybrid families map their own:
:mod:`hyla.model.formats.families`)."""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors import safe_open

from hyla.model.config import HylaConfig
from hyla.model.formats.families.base import head_to_hyla

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


def read_safetensors(root: pathlib.Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers directory's safetensors weights (one file or a sharded
    index), as ``dtype``; ValueError naming the file for missing, pickled or corrupt weights."""
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
    weights = dict(weights)
    out = head_to_hyla(weights, cfg, source)
    for i in range(cfg.n_layers):
        for ours, theirs in layer_map(cfg).items():
            out[f"blocks.{i}.{ours}"] = _take(weights, f"model.layers.{i}.{theirs}", source)
    left = sorted(k for k in weights if not k.endswith("rotary_emb.inv_freq"))
    if left:
        raise ValueError(f"{source} has tensors the config does not account for: {left[:4]} "
                         f"(a bias or norm config.json does not declare): refused, since "
                         f"dropping them would change the model")
    return out


def layer_map(cfg: HylaConfig) -> dict[str, str]:
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

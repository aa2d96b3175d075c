"""Qwen3.5 and Qwen3-Next as llama.cpp writes them (``qwen35``, ``qwen35moe``,
``qwen3next``): the way back to the transformers config and tensors
(:class:`~hyla.model.formats.families.base.GgufMapping`).

What llama.cpp's converter changed, undone here: every RMSNorm weight but the gated delta
rule's own stored as ``1 + w`` (transformers keeps ``w``, applied as ``1 + w``); ``A`` as
``-exp(A_log)``; the convolution squeezed to 2-D; Qwen3-Next's fused ``in_proj_qkvz`` split
into ``attn_qkv`` and ``attn_gate`` (its ``in_proj_ba`` kept as ``ssm_ba``); and, in Qwen3.5
files where a key head serves several value heads, the value heads reordered from grouped
(``[k0: v0 v1, k1: v0 v1]``) to tiled (``[v0 of k0, v0 of k1, v1 of k0, ...]``) in every
tensor that carries them.
"""

from __future__ import annotations

import torch

from hyla.model.formats.families.base import gguf_shape, gguf_value
from hyla.model.formats.families.qwen3_next.tensors import split_ba

MODEL_TYPES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text",
               "qwen3next": "qwen3_next"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
           "output": "lm_head"}
_BLOCK = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
          "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
          "ssm_ba": "linear_attn.in_proj_ba",
          "ssm_conv1d": "linear_attn.conv1d", "ssm_dt": "linear_attn.dt_bias",
          "ssm_a": "linear_attn.A_log", "ssm_norm": "linear_attn.norm",
          "ssm_out": "linear_attn.out_proj", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate",
          "ffn_up_exps": "mlp.experts.up", "ffn_down_exps": "mlp.experts.down_proj",
          "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
          "ffn_up_shexp": "mlp.shared_expert.up_proj",
          "ffn_down_shexp": "mlp.shared_expert.down_proj",
          "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_SHIFTED_NORMS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm")


def gguf_config(meta: dict, shapes: dict, source: str) -> dict:
    """The transformers config.json of a ``qwen35`` / ``qwen35moe`` / ``qwen3next`` file."""
    arch = meta["general.architecture"]

    def get(key, default=None):
        return gguf_value(meta, arch, key, source, default)
    n = int(get("block_count"))
    recurrent = get("attention.recurrent_layers", None)
    interval = int(get("full_attention_interval", 4))
    if recurrent is None:
        recurrent = [(i + 1) % interval != 0 for i in range(n)]
    recurrent = list(recurrent)[:n]
    if len(recurrent) != n:
        raise ValueError(f"{source}: {arch}.attention.recurrent_layers must list {n} layers")
    head_dim = int(get("attention.key_length"))
    v_heads, inner = int(get("ssm.time_step_rank")), int(get("ssm.inner_size"))
    if v_heads < 1 or inner % v_heads:
        raise ValueError(f"{source}: {arch}.ssm.inner_size={inner} must be a multiple of "
                         f"{arch}.ssm.time_step_rank (the value heads)={v_heads}")
    hf = {"model_type": MODEL_TYPES[arch],
          "vocab_size": gguf_shape(shapes, "token_embd.weight", source)[0],
          "hidden_size": int(get("embedding_length")), "num_hidden_layers": n,
          "intermediate_size": int(get("feed_forward_length", 0)),
          "num_attention_heads": int(get("attention.head_count")),
          "num_key_value_heads": int(get("attention.head_count_kv")), "head_dim": head_dim,
          "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
          "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
          "full_attention_interval": interval,
          "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
          "linear_key_head_dim": int(get("ssm.state_size")),
          "linear_num_key_heads": int(get("ssm.group_count")),
          "linear_num_value_heads": v_heads, "linear_value_head_dim": inner // v_heads,
          "rope_parameters": {"rope_type": "default",
                              "rope_theta": float(get("rope.freq_base", 10000.0)),
                              "partial_rotary_factor": int(get("rope.dimension_count"))
                              / head_dim},
          "tie_word_embeddings": "output.weight" not in shapes, "hidden_act": "silu"}
    experts = int(get("expert_count", 0))
    if experts:
        hf |= {"num_experts": experts, "num_experts_per_tok": int(get("expert_used_count")),
               "moe_intermediate_size": int(get("expert_feed_forward_length")),
               "shared_expert_intermediate_size": int(
                   get("expert_shared_feed_forward_length")),
               "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    return hf


def _grouped(t: torch.Tensor, dim: int, k_heads: int, per_k: int, head_dim: int):
    """Value heads from llama.cpp's tiled order back to transformers' grouped one."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per_k, k_heads, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def gguf_tensors(tensors: dict, hf: dict, source: str) -> dict:
    """The file's tensors by transformers' (Qwen3.5) names."""
    hk, hv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dk, dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    r = hv // hk if hf["model_type"] != "qwen3_next" else 1    # Qwen3-Next: not reordered
    out, experts = {}, {}
    for name, w in tensors.items():
        base, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):          # ssm_a has no suffix
            base, suffix = name, "weight"
        if base in _GLOBAL:
            out[f"{_GLOBAL[base]}.{suffix}"] = w - 1 if base == "output_norm" else w
            continue
        parts = base.split(".", 2)
        if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _BLOCK:
            raise ValueError(f"{source} has tensor {name!r}, which has no place in a "
                             f"{hf['model_type']} model")
        _, i, kind = parts
        if kind in _SHIFTED_NORMS:
            w = w - 1
        elif kind == "ssm_a":
            w = torch.log(-w.flatten())
        elif kind == "ssm_conv1d":
            w = w[:, None]
        if r > 1:               # value heads back to grouped order
            if kind == "attn_qkv":
                q, k, v = w.split([hk * dk, hk * dk, hv * dv])
                w = torch.cat([q, k, _grouped(v, 0, hk, r, dv)])
            elif kind == "attn_gate":
                w = _grouped(w, 0, hk, r, dv)
            elif kind in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
                w = _grouped(w, 0, hk, r, 1)
            elif kind == "ssm_conv1d":
                qk, v = w.split([2 * hk * dk, hv * dv])
                w = torch.cat([qk, _grouped(v, 0, hk, r, dv)])
            elif kind == "ssm_out":
                w = _grouped(w, 1, hk, r, dv)
        key = f"model.layers.{i}.{_BLOCK[kind]}"
        if kind in ("ffn_gate_exps", "ffn_up_exps"):
            experts[(i, kind)] = w
        elif kind in ("ssm_a", "ssm_dt"):
            out[key] = w
        elif kind == "ssm_ba":                       # Qwen3-Next: per key-head group
            b, a = split_ba(w, hk, hv)
            out[f"model.layers.{i}.linear_attn.in_proj_b.weight"] = b
            out[f"model.layers.{i}.linear_attn.in_proj_a.weight"] = a
        elif kind == "ffn_gate_inp_shexp":
            out[f"{key}.{suffix}"] = w.reshape(1, -1)
        else:
            out[f"{key}.{suffix}"] = w
    for (i, kind), gate in experts.items():
        if kind == "ffn_gate_exps":         # transformers 5's fused [E, 2I, d]
            up = experts[(i, "ffn_up_exps")]
            out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    if f"model.layers.{next(iter(experts), ('0',))[0]}.mlp.experts.down_proj.weight" in out:
        for i in {i for i, _ in experts}:
            out[f"model.layers.{i}.mlp.experts.down_proj"] = out.pop(
                f"model.layers.{i}.mlp.experts.down_proj.weight")
    return out

"""Qwen3-Next / Qwen3.5 tensor names <-> hyla's (the config side is
:mod:`hyla.model.formats.families.qwen3_next`).

Qwen3-Next fuses q, k, v and the output gate z into ``in_proj_qkvz`` and beta's b with the
decay's a into ``in_proj_ba``, both interleaved per key-head group (:func:`split_qkvz`,
:func:`split_ba`); Qwen3.5 keeps ``in_proj_qkv`` (plain q|k|v), ``in_proj_z``,
``in_proj_b``, ``in_proj_a``. Experts are read per module or fused and written per module.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from hyla.model.config import HylaConfig
from hyla.model.formats.families.base import (
    MoENames,
    check_all_taken,
    head_to_hyla,
    moe_from_hyla,
    moe_to_hyla,
    take,
)
from hyla.model.mixers.deltanet import GatedDeltaMixer, delta_dims

log = logging.getLogger("hyla.model.formats.families.qwen3_next")
NAMES = MoENames(shared="shared_expert")


def moe_options(layer: HylaConfig):
    """The MoE options of one layer's config."""
    from hyla.model.ffn import FFNS

    return FFNS["E"].options(layer)


def to_state(weights: dict, cfg: HylaConfig, source: str) -> dict[str, torch.Tensor]:
    """The file's tensors by hyla's names (``model.`` or ``model.language_model.``)."""
    weights = dict(weights)
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in weights \
        else "model."
    keys = [k for k in weights if k.startswith("model.visual.")]
    if keys:
        log.warning("%s: leaving out the %d vision tower tensors (model.visual.*)", source,
                    len(keys))
        for k in keys:
            del weights[k]
    out = head_to_hyla(weights, cfg, source, prefix)
    for i in range(cfg.n_layers):
        theirs, ours = f"{prefix}layers.{i}", f"blocks.{i}"
        for name, tensor in _layer_to_hyla(weights, theirs, cfg, i, source).items():
            out[f"{ours}.{name}"] = tensor
    out |= _mtp_to_hyla(weights, cfg, source)
    check_all_taken(weights, source)
    return out


def mtp_layers_in(weights: dict) -> int:
    """How many MTP layers (``mtp.layers.{j}.*``) a file's tensors hold."""
    found = {k.split(".")[2] for k in weights if k.startswith("mtp.layers.")}
    return len(found)


def _mtp_to_hyla(w: dict, cfg: HylaConfig, source: str) -> dict:
    """The MTP tensors (``mtp.*``) by hyla's names (:class:`hyla.model.mtp.MTPHead`); the
    caller sets ``cfg.mtp_layers`` to :func:`mtp_layers_in` the file."""
    n = mtp_layers_in(w)
    if not n:
        return {}
    from hyla.model.mtp import mtp_config

    m = mtp_config(dataclasses.replace(cfg, mtp_layers=n))
    out = {f"mtp.{k}": take(w, f"mtp.{k}", source) for k in _MTP_OWN}
    for j in range(n):
        for name, tensor in _layer_to_hyla(w, f"mtp.layers.{j}", m, j, source).items():
            out[f"mtp.layers.{j}.{name}"] = tensor
    return out


_MTP_OWN = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
            "norm.weight")


def _layer_to_hyla(w: dict, p: str, cfg: HylaConfig, i: int, source: str) -> dict:
    layer = cfg.layer_config(i)
    out = {"mixer_norm.weight": take(w, f"{p}.input_layernorm.weight", source),
           "mlp_norm.weight": take(w, f"{p}.post_attention_layernorm.weight", source)}
    if cfg.layers[i] == "A":
        names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                 "q_norm.weight", "k_norm.weight"]
        if cfg.attention_bias:
            names += ["q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias"]
        out |= {f"mixer.{n}": take(w, f"{p}.self_attn.{n}", source) for n in names}
    else:
        a = f"{p}.linear_attn"
        hk, hv, dk, dv = delta_dims(layer, GatedDeltaMixer.options(layer))
        if f"{a}.in_proj_qkvz.weight" in w:           # Qwen3-Next: fused, per key-head group
            q, k, v, z = split_qkvz(take(w, f"{a}.in_proj_qkvz.weight", source), hk, hv, dk, dv)
            b, a_ = split_ba(take(w, f"{a}.in_proj_ba.weight", source), hk, hv)
        else:                                           # Qwen3.5: plain q | k | v, z, b, a
            q, k, v = take(w, f"{a}.in_proj_qkv.weight", source).split(
                [hk * dk, hk * dk, hv * dv])
            z, b, a_ = (take(w, f"{a}.in_proj_{n}.weight", source) for n in "zba")
        out |= {"mixer.q_proj.weight": q, "mixer.k_proj.weight": k, "mixer.v_proj.weight": v,
                "mixer.g_proj.weight": z, "mixer.b_proj.weight": b, "mixer.a_proj.weight": a_,
                "mixer.conv.weight": take(w, f"{a}.conv1d.weight", source),
                "mixer.A_log": take(w, f"{a}.A_log", source),
                "mixer.dt_bias": take(w, f"{a}.dt_bias", source),
                "mixer.o_norm.weight": take(w, f"{a}.norm.weight", source),
                "mixer.o_proj.weight": take(w, f"{a}.out_proj.weight", source)}
    if cfg.ffn_letter(i) == "E":
        opts = moe_options(layer)
        moe = moe_to_hyla(w, f"{p}.mlp", "mlp", opts, NAMES, source)
        out |= {k: v.contiguous() for k, v in moe.items()}
    else:
        out |= {f"mlp.{n}.weight": take(w, f"{p}.mlp.{n}.weight", source)
                for n in ("gate_proj", "up_proj", "down_proj")}
    return {k: v.contiguous() for k, v in out.items()}


def from_state(state: dict, cfg: HylaConfig) -> dict[str, torch.Tensor]:
    """hyla's tensors by the family's names (experts one module each, Qwen3-Next's
    projections fused back)."""
    out = {"model.embed_tokens.weight": state["embed.weight"],
           "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layers):
        out |= _layer_from_hyla(state, f"blocks.{i}", f"model.layers.{i}", cfg, i)
    if cfg.mtp_layers:
        from hyla.model.mtp import mtp_config

        m = mtp_config(cfg)
        out |= {f"mtp.{k}": state[f"mtp.{k}"] for k in _MTP_OWN}
        for j in range(cfg.mtp_layers):
            out |= _layer_from_hyla(state, f"mtp.layers.{j}", f"mtp.layers.{j}", m, j)
    return {k: v.contiguous() for k, v in out.items()}


def _layer_from_hyla(state: dict, s: str, p: str, cfg: HylaConfig, i: int) -> dict:
    """Layer ``i`` of ``cfg`` (hyla's ``s``.*) by the family's names (``p``.*)."""
    out = {}
    layer = cfg.layer_config(i)
    out[f"{p}.input_layernorm.weight"] = state[f"{s}.mixer_norm.weight"]
    out[f"{p}.post_attention_layernorm.weight"] = state[f"{s}.mlp_norm.weight"]
    if cfg.layers[i] == "A":
        for k in [k for k in state if k.startswith(f"{s}.mixer.")]:
            out[f"{p}.self_attn.{k[len(s) + 7:]}"] = state[k]
    else:
        m, a = f"{s}.mixer", f"{p}.linear_attn"
        dims = delta_dims(layer, GatedDeltaMixer.options(layer))
        q, k, v, z, b, a_ = (state[f"{m}.{n}_proj.weight"] for n in "qkvgba")
        if cfg.family == "qwen3_next":
            out[f"{a}.in_proj_qkvz.weight"] = fuse_qkvz(q, k, v, z, *dims)
            out[f"{a}.in_proj_ba.weight"] = fuse_ba(b, a_, *dims[:2])
        else:
            out |= {f"{a}.in_proj_qkv.weight": torch.cat([q, k, v]),
                    f"{a}.in_proj_z.weight": z, f"{a}.in_proj_b.weight": b,
                    f"{a}.in_proj_a.weight": a_}
        out |= {f"{a}.conv1d.weight": state[f"{m}.conv.weight"],
                f"{a}.A_log": state[f"{m}.A_log"], f"{a}.dt_bias": state[f"{m}.dt_bias"],
                f"{a}.norm.weight": state[f"{m}.o_norm.weight"],
                f"{a}.out_proj.weight": state[f"{m}.o_proj.weight"]}
    if cfg.ffn_letter(i) == "E":
        out |= moe_from_hyla(state, f"{s}.mlp", f"{p}.mlp", moe_options(layer), NAMES)
    else:
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}.mlp.{n}.weight"] = state[f"{s}.mlp.{n}.weight"]
    return out


def split_qkvz(w: torch.Tensor, hk: int, hv: int, dk: int, dv: int):
    """Qwen3-Next's fused ``in_proj_qkvz`` [hk * (2 dk + 2 r dv), d] (r = hv / hk) into the
    q [hk dk, d], k, v [hv dv, d] and z [hv dv, d] rows. transformers views it per key-head
    group: group j holds q_j, k_j, then the r value heads and r gate heads of the group.

    Example:
        >>> q, k, v, z = split_qkvz(torch.arange(12.0)[:, None], 2, 4, 1, 1)
        >>> q[:, 0].tolist(), v[:, 0].tolist(), z[:, 0].tolist()
        ([0.0, 6.0], [2.0, 3.0, 8.0, 9.0], [4.0, 5.0, 10.0, 11.0])
    """
    r = hv // hk
    parts = w.view(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
    return tuple(p.reshape(-1, w.shape[-1]) for p in parts)


def fuse_qkvz(q, k, v, z, hk: int, hv: int, dk: int, dv: int) -> torch.Tensor:
    """The inverse of :func:`split_qkvz`.

    Example:
        >>> w = torch.randn(12, 3)
        >>> torch.equal(fuse_qkvz(*split_qkvz(w, 2, 4, 1, 1), 2, 4, 1, 1), w)
        True
    """
    r, d = hv // hk, q.shape[-1]
    return torch.cat([q.view(hk, dk, d), k.view(hk, dk, d), v.view(hk, r * dv, d),
                      z.view(hk, r * dv, d)], dim=1).reshape(-1, d)


def split_ba(w: torch.Tensor, hk: int, hv: int):
    """``in_proj_ba`` [2 hv, d] -> (b [hv, d], a [hv, d]): per key-head group, its r b rows
    then its r a rows.

    Example:
        >>> b, a = split_ba(torch.arange(8.0)[:, None], 2, 4)
        >>> b[:, 0].tolist(), a[:, 0].tolist()
        ([0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0])
    """
    r = hv // hk
    b, a = w.view(hk, 2 * r, -1).split([r, r], dim=1)
    return b.reshape(hv, -1), a.reshape(hv, -1)


def fuse_ba(b, a, hk: int, hv: int) -> torch.Tensor:
    """The inverse of :func:`split_ba`."""
    r, d = hv // hk, b.shape[-1]
    return torch.cat([b.view(hk, r, d), a.view(hk, r, d)], dim=1).reshape(-1, d)

"""A transformers model family as hyla reads and writes it: four pure functions.

Each hybrid family (Qwen3-Next / Qwen3.5, Kimi Linear, Ring-2.5, MiMo-V2-Flash, OLMo hybrid)
is one module of this package that builds a :class:`Family` and registers it under its
``model_type`` values. A family maps its config onto :class:`~hyla.model.HylaConfig` (layer
letters, FFN letters, the mixers' and FFNs' options, per-layer overrides) and its weight
names onto hyla's, both ways; nothing outside ``mixers/``, ``ffn/`` and ``formats/`` knows a
family. Every config field a family cannot represent is refused with a ValueError naming the
file and the field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hyla.model.config import HylaConfig


@dataclass(frozen=True)
class GgufMapping:
    """How llama.cpp writes a family (``convert_hf_to_gguf.py``): its GGUF architecture
    names, and the way back to the transformers config and tensors, after which the
    family's own readers apply.

    - ``config(meta, shapes, source) -> dict``: the transformers ``config.json`` (with its
      ``model_type``) the file's ``<arch>.*`` metadata and its tensors' shapes (by name)
      describe;
    - ``tensors(tensors, hf, source) -> dict``: the file's tensors (dequantised, by their
      GGUF names) by transformers' names, llama.cpp's reshapes undone (``A = -exp(A_log)``
      back to ``A_log``, squeezed convolutions unsqueezed, ...).
    """

    archs: tuple[str, ...]
    config: Callable[[dict, dict[str, tuple[int, ...]], str], dict]
    tensors: Callable[[dict[str, torch.Tensor], dict, str], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Family:
    """How one transformers family maps onto hyla.

    - ``to_config(hf: dict, source: str) -> HylaConfig`` (``cfg.family`` set to the
      model_type, so export writes the family back);
    - ``to_state(weights: dict, cfg, source: str) -> dict``: the file's tensors by hyla's
      names; a tensor without a place is refused; multi-token-prediction layers are dropped
      with a logged note;
    - ``from_config(cfg) -> dict``: the family's ``config.json``;
    - ``from_state(state: dict, cfg) -> dict``: hyla's tensors by the family's names;
    - ``fold(weights: dict, hf: dict, source: str) -> dict`` (optional): a checkpoint's
      tensors with what its config multiplies into them folded in, before ``to_state``
      (Falcon-H1's muP multipliers, folded as llama.cpp's converter folds them); export
      then writes those multipliers as 1;
    - ``layout(cfg) -> HylaConfig`` (optional): ``cfg`` (a hybrid of ``A`` layers and the
      family's linear letter, with any model's shapes) given the family's layer options,
      norms and name, so that it exports as the family: what ``hyla distill --recipe``
      builds a student in a shipped layout as.
    """

    model_types: tuple[str, ...]
    architecture: str
    to_config: Callable[[dict, str], HylaConfig]
    to_state: Callable[[dict, HylaConfig, str], dict[str, torch.Tensor]]
    from_config: Callable[[HylaConfig], dict]
    from_state: Callable[[dict, HylaConfig], dict[str, torch.Tensor]]
    gguf: GgufMapping | None = None
    fold: Callable[[dict, dict, str], dict[str, torch.Tensor]] | None = None
    layout: Callable[[HylaConfig], HylaConfig] | None = None


FAMILIES: dict[str, Family] = {}
GGUF_FAMILIES: dict[str, Family] = {}      # by GGUF architecture (general.architecture)


def register_family(family: Family) -> Family:
    """Make ``family`` the reader and writer of each of its ``model_types``. Its readers are
    guarded: a file whose fields or tensors do not fit the family's layout (a shape that
    cannot split, a field of the wrong type) is a ValueError naming the file, never a
    traceback from deep inside a reshape."""
    family = dataclasses.replace(family, to_config=_guarded(family.to_config, "config"),
                                 to_state=_guarded(family.to_state, "tensors"),
                                 fold=family.fold and _guarded(family.fold, "tensors"))
    for model_type in family.model_types:
        FAMILIES[model_type] = family
    for arch in family.gguf.archs if family.gguf else ():
        GGUF_FAMILIES[arch] = family
    return family


def _guarded(read: Callable, what: str) -> Callable:
    if getattr(read, "guarded", False):
        return read

    @functools.wraps(read)
    def call(*args):
        try:
            return read(*args)
        except (KeyError, TypeError, RuntimeError, IndexError, AttributeError) as e:
            raise ValueError(f"{args[-1]}: its {what} do not fit the layout this family "
                             f"expects ({type(e).__name__}: {e})") from e

    call.guarded = True
    return call


def gguf_value(meta: dict, arch: str, key: str, source: str, default=None):
    """``meta["<arch>.<key>"]`` of a GGUF file, or ``default``; a ValueError naming the file
    and the key when it is missing and there is no default."""
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
        raise ValueError(f"{source}: GGUF metadata has no {arch}.{key}")
    return value


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time interleaving of each head's rotary halves (rows of q or
    k, weight or bias; llama-style architectures): row ``2i + j`` of a head goes back to
    ``j * half + i``.

    Example:
        >>> unpermute_rows(torch.tensor([0, 2, 1, 3]), 1).tolist()
        [0, 1, 2, 3]
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def mamba2_gguf_tensor(kind: str, suffix: str, w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """One of llama.cpp's Mamba-2 block tensors (``ssm_*``, as granitehybrid and nemotron_h
    write them) as transformers holds it: ``A = -exp(A_log)`` undone, D and the gated norm's
    groups flattened, the convolution 2-D again; and whether its name takes no ``.weight``
    suffix in transformers (A_log, D, dt_bias)."""
    if kind == "ssm_a":
        w = torch.log(-w.flatten())
    elif kind == "ssm_d":
        w = w.flatten()
    elif kind in ("ssm_norm", "ssm_conv1d") and suffix == "weight":
        w = w.flatten() if kind == "ssm_norm" else w[:, None]
    return w, kind in ("ssm_a", "ssm_d", "ssm_dt")


def time_step_limit(hf: dict) -> tuple[float, float]:
    """A Mamba-2 config's ``time_step_limit`` (default ``(0, inf)``); transformers writes
    infinity as ``{"__float__": "Infinity"}`` (JSON has no inf).

    Example:
        >>> time_step_limit({"time_step_limit": [0.0, {"__float__": "Infinity"}]})
        (0.0, inf)
    """
    return tuple(float(v["__float__"]) if isinstance(v, dict) else float(v)
                 for v in hf.get("time_step_limit") or (0.0, math.inf))


def gguf_shape(shapes: dict, name: str, source: str) -> tuple[int, ...]:
    """The shape of GGUF tensor ``name``, or a ValueError naming the file and the tensor."""
    if name not in shapes:
        raise ValueError(f"{source}: the file has no tensor {name!r}")
    return shapes[name]


def require(hf: dict, key: str, source: str, kind: str):
    """``hf[key]``, or a ValueError naming the file and the missing field."""
    if key not in hf or hf[key] is None:
        raise ValueError(f"{source} has no {key!r}: expected a complete {kind} config")
    return hf[key]


def refuse(hf: dict, source: str, checks: dict[str, Callable[[object], bool]],
           why: str = "hyla cannot represent it") -> None:
    """ValueError naming the first field of ``checks`` whose value (when present) fails its
    predicate."""
    for key, ok in checks.items():
        if key in hf and not ok(hf[key]):
            raise ValueError(f"{source}: {key}={hf[key]!r} is not supported: {why}")


def take(weights: dict, key: str, source: str) -> torch.Tensor:
    """Pop ``key`` from a state dict, or a ValueError naming the file and the tensor."""
    if key not in weights:
        raise ValueError(f"{source} has no tensor {key!r}")
    return weights.pop(key)


def check_all_taken(weights: dict, source: str) -> None:
    """ValueError when tensors are left that the config does not account for."""
    left = sorted(k for k in weights if not k.endswith("rotary_emb.inv_freq"))
    if left:
        raise ValueError(f"{source} has tensors the config does not account for: {left[:4]} "
                         f"({len(left)} in all): refused, since dropping them would change "
                         f"the model")


def head_to_hyla(weights: dict, cfg: HylaConfig, source: str,
                 prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Embedding, final norm and lm_head by hyla's names. With tied embeddings a file's
    ``lm_head.weight`` must equal the embedding (transformers would use a different one
    untied, so loading it tied would compute something else)."""
    out = {"embed.weight": take(weights, f"{prefix}embed_tokens.weight", source),
           "norm.weight": take(weights, f"{prefix}norm.weight", source)}
    head = weights.pop("lm_head.weight", None)
    if not cfg.tie_embeddings:
        if head is None:
            raise ValueError(f"{source} has no tensor 'lm_head.weight' (tie_word_embeddings "
                             f"is false)")
        out["lm_head.weight"] = head
    elif head is not None and not torch.equal(head, out["embed.weight"]):
        raise ValueError(f"{source}: lm_head.weight differs from {prefix}embed_tokens.weight "
                         f"although tie_word_embeddings is true")
    return out


def head_from_hyla(state: dict, cfg: HylaConfig, prefix: str = "model.") -> dict:
    """The inverse of :func:`head_to_hyla` (a tied head is not written)."""
    out = {f"{prefix}embed_tokens.weight": state["embed.weight"],
           f"{prefix}norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return out


@dataclass(frozen=True)
class MoENames:
    """A family's names inside its MoE block (after ``model.layers.<i>.mlp.``)."""

    router: str = "gate.weight"
    score_bias: str = "gate.e_score_correction_bias"
    shared: str = "shared_experts"          # Qwen3-Next: "shared_expert"
    shared_gate: str = "shared_expert_gate.weight"


def moe_to_hyla(weights: dict, theirs: str, ours: str, opts, names: MoENames,
                source: str) -> dict[str, torch.Tensor]:
    """A family's MoE tensors under ``theirs`` (``model.layers.3.mlp``) as hyla's
    :class:`~hyla.model.ffn.MoEFFN` under ``ours`` (``blocks.3.mlp``). Experts come either
    one module an expert (``experts.<e>.gate_proj.weight``, what checkpoints hold) or fused
    (``experts.gate_up_proj`` [E, 2I, d], ``experts.down_proj`` [E, d, I]: transformers 5's
    in-memory layout)."""
    out = {f"{ours}.router.weight": take(weights, f"{theirs}.{names.router}", source)}
    if opts.score_bias:
        out[f"{ours}.score_bias"] = take(weights, f"{theirs}.{names.score_bias}", source)
    fused = f"{theirs}.experts.gate_up_proj"
    if fused in weights:
        out[f"{ours}.gate_up"] = take(weights, fused, source)
        out[f"{ours}.down"] = take(weights, f"{theirs}.experts.down_proj", source)
    else:
        e = range(opts.num_experts)
        gate = [take(weights, f"{theirs}.experts.{i}.gate_proj.weight", source) for i in e]
        up = [take(weights, f"{theirs}.experts.{i}.up_proj.weight", source) for i in e]
        down = [take(weights, f"{theirs}.experts.{i}.down_proj.weight", source) for i in e]
        out[f"{ours}.gate_up"] = torch.stack([torch.cat(p) for p in zip(gate, up, strict=True)])
        out[f"{ours}.down"] = torch.stack(down)
    if opts.shared_dim:
        for p in ("gate_proj", "up_proj", "down_proj"):
            out[f"{ours}.shared.{p}.weight"] = take(
                weights, f"{theirs}.{names.shared}.{p}.weight", source)
        if opts.shared_gate:
            out[f"{ours}.shared_gate.weight"] = take(
                weights, f"{theirs}.{names.shared_gate}", source)
    return out


def moe_from_hyla(state: dict, ours: str, theirs: str, opts,
                  names: MoENames) -> dict[str, torch.Tensor]:
    """The inverse of :func:`moe_to_hyla`, experts one module each (the checkpoint layout)."""
    out = {f"{theirs}.{names.router}": state[f"{ours}.router.weight"]}
    if opts.score_bias:
        out[f"{theirs}.{names.score_bias}"] = state[f"{ours}.score_bias"]
    gate_up, down = state[f"{ours}.gate_up"], state[f"{ours}.down"]
    width = opts.expert_dim
    for i in range(opts.num_experts):
        out[f"{theirs}.experts.{i}.gate_proj.weight"] = gate_up[i, :width].contiguous()
        out[f"{theirs}.experts.{i}.up_proj.weight"] = gate_up[i, width:].contiguous()
        out[f"{theirs}.experts.{i}.down_proj.weight"] = down[i].contiguous()
    if opts.shared_dim:
        for p in ("gate_proj", "up_proj", "down_proj"):
            out[f"{theirs}.{names.shared}.{p}.weight"] = state[f"{ours}.shared.{p}.weight"]
        if opts.shared_gate:
            out[f"{theirs}.{names.shared_gate}"] = state[f"{ours}.shared_gate.weight"]
    return out

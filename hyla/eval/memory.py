"""Per-sequence memory of a hybrid model versus the KV cache of an all-attention model.

Everything here is computed from the config alone (the parameter count comes from a model
built on the meta device, which allocates nothing), so it runs in milliseconds for a 3B
config. The formula is checked against a real :class:`hyla.model.SequenceState` in the tests.

Every size comes from the mixers' :class:`~hyla.model.mixers.StateSpec` (one per layer):
fixed entries (a GLA layer's fp32 ``[H, K, V]`` matrix, whatever the context) plus growing
ones times the context (an attention layer's keys and values, ``2 * kv_dim`` values a
token in ``kv_dtype``). The baseline is a model of the same width and depth with softmax
attention in every layer.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from hyla.model import sizing
from hyla.model.config import HylaConfig, preset
from hyla.model.mixers import MIXERS, AttentionMixer, layer_specs

GIB = 1024**3

# Figures published for the reference 3B GLA model at 8192 tokens. Our config reproduces them
# to within 4%: 28.3 MB of state (published 29.5 MB) and ~85x (published ~82x).
PUBLISHED = {"laplace-3b": {"context": 8192, "state_bytes": 29.5e6, "ratio": 82.0}}

_SUFFIX = {"": 1, "K": 1024, "M": 1024**2}


def parse_context(value: str | int) -> int:
    """Parse a context length: ``8192``, ``"8192"``, ``"8K"`` / ``"8k"`` (x1024), ``"1M"``.

    Example:
        >>> parse_context("8K"), parse_context("1m"), parse_context(512)
        (8192, 1048576, 512)
    """
    if isinstance(value, bool):
        raise ValueError(f"context must be a positive int such as 8192 or '8K', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(value))
        if not m:
            raise ValueError(f"context must be a positive int such as 8192 or '8K', "
                             f"got {value!r}")
        n = int(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if n <= 0:
        raise ValueError(f"context must be positive, got {value!r}")
    return n


def _dtype_bytes(dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def state_bytes(cfg: HylaConfig, context: int | str,
                kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Per-sequence state of the hybrid ``cfg`` after ``context`` tokens, in bytes.

    Returns ``{"total", "fixed", "growing", "per_layer": [...], "groups"}`` plus one key
    per registered layer kind (``"gla"``, ``"attention"``, ...; 0 for kinds ``cfg`` lacks);
    ``groups``: bytes by memory group (full attention, window, recurrent:
    :attr:`~hyla.model.mixers.StateSpec.group`), which the serving engine pools apart.
    ``fixed`` is what a sequence keeps whatever its length, ``growing`` what its
    ``context`` tokens add. ``kv_dtype`` is the model dtype (that of attention caches).

    Example:
        >>> s = state_bytes(preset("laplace-3b"), 8192)
        >>> s["total"], s["attention"], s["fixed"]
        (28311552, 0, 28311552)
    """
    n = parse_context(context)
    _dtype_bytes(kv_dtype)
    specs = layer_specs(cfg)
    per_layer = [spec.nbytes(n, kv_dtype) for spec in specs]
    out = {"total": sum(per_layer),
           "fixed": sum(spec.fixed_bytes(kv_dtype) for spec in specs),
           "growing": n * sum(spec.per_token_bytes(kv_dtype) for spec in specs),
           "per_layer": per_layer}
    out.update({m.kind: 0 for m in MIXERS.values()})
    out["groups"] = {"full attention": 0, "window": 0, "recurrent": 0}
    for spec, b in zip(specs, per_layer, strict=True):
        out[spec.kind] += b
        out["groups"][spec.group] += b
    return out


def kv_cache_bytes(cfg: HylaConfig, context: int | str,
                   kv_dtype: torch.dtype = torch.bfloat16) -> int:
    """KV cache of an all-attention model with ``cfg``'s width and depth, one sequence.

    Example:
        >>> kv_cache_bytes(preset("laplace-3b"), "8K")  # 24 * 2 * 8192 * 3072 * 2
        2415919104
    """
    return state_bytes(all_attention(cfg), context, kv_dtype)["total"]


def num_parameters(cfg: HylaConfig) -> int:
    """Parameter count of ``HylaLM(cfg)``, built on the meta device (no memory, fast).

    Example:
        >>> num_parameters(preset("laplace-3b"))
        3028938240
    """
    return sizing.meta_model(cfg).num_parameters()


# Fields of a layer's feed-forward half: the all-attention baseline keeps each layer's own.
_FFN_FIELDS = ("ffn_dim", "ffn_options")


def full_attention_layer(cfg: HylaConfig) -> int | None:
    """The first layer whose state grows a row a token and that sees the whole context
    (softmax attention, MLA, ... without a sliding window); None when there is none."""
    windows = sizing.layer_windows(cfg)
    for i, spec in enumerate(layer_specs(cfg)):
        if spec.per_token and windows[i] is None:
            return i
    return None


def all_attention(cfg: HylaConfig) -> HylaConfig:
    """The baseline: ``cfg`` with every layer its first full-attention layer (the same kind,
    heads and options, e.g. MLA for Kimi Linear), or hyla's ``A`` with ``cfg``'s attention
    fields when it has none. Each layer keeps its own FFN (dense or MoE), so width, depth
    and FFNs, hence nearly the active parameters, are the model's.

    Example:
        >>> cfg = HylaConfig(vocab_size=256, d_model=64, layers="GAA", n_heads=4, ffn_dim=128,
        ...                  layer_overrides=[{}, {"sliding_window": 8}, {"n_kv_heads": 2}])
        >>> base = all_attention(cfg)
        >>> base.layers, [base.layer_config(i).n_kv_heads for i in range(3)]
        ('AAA', [2, 2, 2])
    """
    ref = full_attention_layer(cfg)
    letter = AttentionMixer.letter if ref is None else cfg.layers[ref]
    if not cfg.layer_overrides:
        return dataclasses.replace(cfg, layers=letter * cfg.n_layers)
    mixer = {} if ref is None else {k: v for k, v in cfg.layer_overrides[ref].items()
                                    if k not in _FFN_FIELDS}
    overrides = [{**{k: v for k, v in o.items() if k in _FFN_FIELDS}, **mixer}
                 for o in cfg.layer_overrides]
    return dataclasses.replace(cfg, layers=letter * cfg.n_layers, layer_overrides=overrides)


def _kind_rows(cfg: HylaConfig, context: int, kv_dtype: torch.dtype) -> list[dict]:
    """Per layer kind in the hybrid or its all-attention baseline: its label, layer counts
    and state bytes in both, and the dtypes its state is kept in (read from every layer's
    own StateSpec: layers of one kind may differ)."""
    base = all_attention(cfg)
    hybrid, baseline = state_bytes(cfg, context, kv_dtype), state_bytes(base, context, kv_dtype)
    specs = [*zip(cfg.layers, layer_specs(cfg), strict=True),
             *zip(base.layers, layer_specs(base), strict=True)]
    rows = []
    letters = sorted(MIXERS, key=lambda c: (cfg.layers + base.layers + c).index(c))
    for letter in letters:          # in the order the hybrid's layers first use them
        mixer = MIXERS[letter]
        n, nb = cfg.layers.count(letter), base.layers.count(letter)
        if n or nb:
            dtypes = {str(e.resolve(kv_dtype)).removeprefix("torch.")
                      for c, spec in specs if c == letter for e in spec.entries}
            rows.append({"kind": mixer.kind, "label": mixer.label, "layers": n,
                         "baseline_layers": nb, "bytes": hybrid[mixer.kind],
                         "baseline_bytes": baseline[mixer.kind],
                         "state_label": mixer.state_label, "dtype": "/".join(sorted(dtypes))})
    return rows


def _fit(budget_bytes: float | None, weight_bytes: int, per_sequence: int) -> int | None:
    if budget_bytes is None:
        return None
    free = budget_bytes - weight_bytes
    if free <= 0:
        return 0
    if per_sequence == 0:  # a model with no per-sequence state: unbounded
        return None
    return int(free // per_sequence)


def memory_report(cfg: HylaConfig | str, context: int | str, budget_gib: float | None = None,
                  *, kv_dtype: torch.dtype = torch.bfloat16,
                  weight_dtype: torch.dtype = torch.bfloat16, model: str | None = None) -> dict:
    """Hybrid state vs all-attention KV cache at ``context`` tokens, plus what fits in memory.

    ``cfg`` is a config or a preset name. With ``budget_gib``, ``sequences_fit`` says how many
    sequences fit in that many GiB once the weights are loaded, for the hybrid and for the
    all-attention baseline (its own weights, from its own meta-device parameter count).

    Keys: ``preset``, ``context``, ``state_bytes``, ``state_breakdown`` (by layer kind),
    ``kinds`` (a row per layer kind in either model: label, layers, bytes, dtype),
    ``layers`` (count by kind), ``kv_bytes``, ``ratio`` (kv / state), ``params``,
    ``weight_bytes``, ``attention_params``, ``attention_weight_bytes``, ``budget_gib``,
    ``sequences_fit`` ({"hybrid", "attention"}, None without a budget), ``kv_dtype``,
    ``weight_dtype``, and ``published`` (figures published for this preset, or None).
    Also ``model`` (``model``, e.g. the directory a config came from, or the preset name),
    ``active_params`` and ``attention_active_params`` (a token's: a mixture of experts
    counts its routed top-k and shared experts; :func:`hyla.model.sizing.parameter_counts`),
    ``moe_layers``, ``windowed_layers`` (layers with a sliding window, which keep a ring of
    their window: ``state_bytes`` counts it whole) and ``bounded_state_bytes``: the rows
    those rings have filled at ``context`` (less than ``state_bytes`` below a window).

    Example:
        >>> r = memory_report("laplace-3b", "8K", budget_gib=80)
        >>> round(r["ratio"]), r["sequences_fit"]
        (85, {'hybrid': 2820, 'attention': 33})
    """
    name = cfg if isinstance(cfg, str) else None
    if name is not None:
        cfg = preset(name)
    n = parse_context(context)
    if budget_gib is not None and not budget_gib > 0:
        raise ValueError(f"budget_gib must be > 0, got {budget_gib!r}")
    state = state_bytes(cfg, n, kv_dtype)
    kv = kv_cache_bytes(cfg, n, kv_dtype)
    wbytes = _dtype_bytes(weight_dtype)
    counts = sizing.parameter_counts(cfg)
    params = counts["total"]
    baseline = all_attention(cfg)
    base_counts = counts if baseline == cfg else sizing.parameter_counts(baseline)
    attn_params = base_counts["total"]
    budget = budget_gib * GIB if budget_gib is not None else None
    fit = None
    if budget is not None:
        fit = {"hybrid": _fit(budget, params * wbytes, state["total"]),
               "attention": _fit(budget, attn_params * wbytes, kv)}
    published = PUBLISHED.get(name) if name is not None else None
    return {
        "preset": name,
        "model": model or name,
        "context": n,
        "state_bytes": state["total"],
        "bounded_state_bytes": sizing.bounded_state_bytes(cfg, n, kv_dtype),
        "windowed_layers": sum(w is not None for w in sizing.layer_windows(cfg)),
        "state_breakdown": {m.kind: state[m.kind] for m in MIXERS.values()},
        "state_groups": state["groups"],
        "kinds": _kind_rows(cfg, n, kv_dtype),
        "layers": {m.kind: cfg.layers.count(k) for k, m in MIXERS.items()},
        "kv_bytes": kv,
        "ratio": kv / state["total"],
        "params": params,
        "active_params": counts["active"],
        "moe_layers": counts["moe_layers"],
        "weight_bytes": params * wbytes,
        "attention_params": attn_params,
        "attention_active_params": base_counts["active"],
        "attention_weight_bytes": attn_params * wbytes,
        "budget_gib": budget_gib,
        "sequences_fit": fit,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "weight_dtype": str(weight_dtype).removeprefix("torch."),
        "published": published if published and published["context"] == n else None,
    }

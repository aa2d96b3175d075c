"""Cost model of the simulator: model sizes, accelerator rooflines, engine-step time.

Published specs (NVIDIA datasheets, dense, no sparsity): H200 SXM 989 TFLOP/s bf16, 4.8 TB/s
HBM3e, 141 GB; H100 SXM 989 TFLOP/s, 3.35 TB/s, 80 GB; H20 148 TFLOP/s bf16, 4.0 TB/s, 96 GB.
Assumptions (ours, not published): an instance is 8 GPUs serving one model replica; prefill
reaches ``mfu`` = 45% of peak FLOP/s, decode ``mbu`` = 80% of peak memory bandwidth, plus a
fixed per-step overhead of 2 ms.

An engine step's time is a roofline over the whole step (prefill chunks and the decode batch
together)::

    flops = 2 * active_params * tokens + attn_pair_flops * (query, key) pairs
            + linear_token_flops * tokens
    bytes = weights touched + KV read (context of every token) + KV written
            + linear state read and written (per sequence in the step)
    time  = max(flops / (peak * mfu), bytes / (bandwidth * mbu)) + overhead

Weights touched: all of them for a dense model; for a mixture of experts the expected share
of experts hit by ``tokens`` tokens, ``1 - (1 - active/total) ** tokens``.

A *measured* profile replaces the roofline by figures from hyla's own engine
(:func:`load_measured_profile`); see its docstring for the JSON format.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GPU:
    name: str
    tflops: float          # dense bf16 tensor-core peak
    hbm_tb_s: float
    mem_gb: float
    source: str = "published spec (NVIDIA datasheet)"


GPUS = {
    "H200": GPU("H200", 989.0, 4.8, 141.0),
    "H100": GPU("H100", 989.0, 3.35, 80.0),
    "H20": GPU("H20", 148.0, 4.0, 96.0),
}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the cost model needs to know about a model, per sequence and per token.

    ``kv_bytes_per_token``: KV bytes one token adds, summed over the attention layers.
    ``state_bytes``: the fixed per-sequence state of the linear layers (GLA matrices).
    ``attn_pair_flops``: FLOPs per (query, key) pair, summed over attention layers
    (4 * heads * head_dim for QK^T plus PV). ``linear_token_flops``: per token, the linear
    layers' state work. ``weight_bytes``: bytes of all weights as served.
    """

    name: str
    total_params: float
    active_params: float
    weight_bytes: float
    kv_bytes_per_token: float
    state_bytes: float
    attn_pair_flops: float
    linear_token_flops: float = 0.0
    layers: str = ""
    source: str = ""

    def transfer_bytes(self, prompt_tokens: int) -> float:
        """Bytes a prefill hands to decode for a prompt: KV of every token plus the state."""
        return self.kv_bytes_per_token * prompt_tokens + self.state_bytes

    def seq_bytes(self, tokens: int) -> float:
        """Memory one sequence of ``tokens`` holds on a decode instance."""
        return self.kv_bytes_per_token * tokens + self.state_bytes

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def published_1t_hybrid(layers: str | None = None, attention: str = "mla") -> ModelSpec:
    """The case study's model, as we reconstruct it (the paper's model is internal).

    Published: 1T parameters, hybrid, 7:1 linear:full attention, MLA full attention
    (Ring-2.5-1T-like). Assumed here: 50B active parameters, 80 layers (70 linear + 10 MLA),
    MLA cache 576 bf16 values a token a layer (512 latent + 64 rope), 128 query heads of
    192 (QK) / 128 (V) dims, linear layers with 64 heads of 128 x 128 fp32 state, weights
    served in 4 bits (0.5 byte a parameter) so that a replica fits 8 H20.
    ``layers`` overrides the mix (e.g. all attention for the dense comparison);
    ``attention="gqa"`` swaps MLA for grouped-query attention with 8 KV heads of 128 (bf16),
    the conventional dense layout.
    """
    layers = layers or ("GGGGGGGA" * 10)
    if attention not in ("mla", "gqa"):
        raise ValueError(f"attention must be 'mla' or 'gqa', got {attention!r}")
    n_attn, n_lin = layers.count("A"), layers.count("G")
    kv_values = 576 if attention == "mla" else 2 * 8 * 128
    return ModelSpec(
        name="1T hybrid (7:1)" if layers == "GGGGGGGA" * 10 else f"1T ({_mix(layers)})",
        total_params=1.0e12, active_params=50e9, weight_bytes=0.5e12,
        kv_bytes_per_token=n_attn * kv_values * 2, state_bytes=n_lin * 64 * 128 * 128 * 4,
        attn_pair_flops=n_attn * 2 * 128 * (192 + 128),
        linear_token_flops=n_lin * 4 * 64 * 128 * 128, layers=layers,
        source="published: 1T params, 7:1 hybrid, MLA; assumed: the rest (see docstring)")


def _mix(layers: str) -> str:
    a, g = layers.count("A"), layers.count("G")
    return "dense" if g == 0 else ("linear only" if a == 0 else f"{g // a}:1 hybrid")


def spec_from_config(cfg, name: str | None = None, weight_dtype_bytes: float = 2,
                     kv_dtype=None) -> ModelSpec:
    """A :class:`ModelSpec` from a :class:`hyla.model.HylaConfig` (imports torch, lazily).

    Read layer by layer from ``cfg.layer_config(i)`` (layers of one kind may differ):
    state and KV bytes from each layer's StateSpec, FLOPs from its mixer's own counts.
    Parameters from a meta-device model (:func:`hyla.model.sizing.parameter_counts`):
    ``active_params`` are a token's block parameters (a mixture of experts counts its routed
    top-k and shared experts; the embedding lookup and the output head, which prefill runs
    for its last token only, are left out), ``weight_bytes`` all of them at
    ``weight_dtype_bytes`` each. A sliding-window layer keeps its window: its keys count as
    fixed state (``window`` tokens of them) and its (query, key) pairs, ``window`` a token,
    as per-token work. ``kv_dtype``: the attention KV's torch dtype (default bf16; hyla's
    CPU engine keeps fp32).

    Example:
        >>> from hyla.model.config import preset
        >>> spec = spec_from_config(preset("debug"))
        >>> spec.layers, spec.kv_bytes_per_token          # one A layer: 2 KV heads of 16
        ('GGGA', 128)
    """
    import torch

    from hyla.model import sizing
    from hyla.model.mixers import MIXERS, layer_specs

    kv_dtype = kv_dtype or torch.bfloat16
    counts = sizing.parameter_counts(cfg)
    kv_token = state = 0
    pair = token = 0.0
    windows = sizing.layer_windows(cfg)
    for i, (letter, spec) in enumerate(zip(cfg.layers, layer_specs(cfg), strict=True)):
        mixer, layer, w = MIXERS[letter], cfg.layer_config(i), windows[i]
        state += spec.fixed_bytes(kv_dtype)
        token += mixer.token_flops(layer)
        if w is None:
            kv_token += spec.per_token_bytes(kv_dtype)
            pair += mixer.pair_flops(layer)
        else:
            state += w * spec.per_token_bytes(kv_dtype)
            token += w * mixer.pair_flops(layer)
    return ModelSpec(
        name=name or f"hyla {cfg.layers[:8]}{'...' if cfg.n_layers > 8 else ''}",
        total_params=counts["total"], active_params=counts["matmul_active"],
        weight_bytes=counts["total"] * weight_dtype_bytes, kv_bytes_per_token=kv_token,
        state_bytes=state, attn_pair_flops=pair, linear_token_flops=token, layers=cfg.layers,
        source="hyla config (per-layer state specs; active parameters)")


@dataclass(kw_only=True)
class InstanceProfile:
    """One serving instance (a model replica) on ``gpus`` accelerators of one kind.

    Roofline unless ``measured`` is set (then step time comes from the measured figures).
    """

    gpu: str
    gpus: int = 8
    mfu: float = 0.45
    mbu: float = 0.80
    step_overhead_s: float = 0.002
    mem_reserve: float = 0.10       # activations, fragmentation
    measured: dict | None = field(default=None)

    @property
    def spec(self) -> GPU:
        return GPUS[self.gpu]

    @property
    def flops(self) -> float:
        return self.gpus * self.spec.tflops * 1e12 * self.mfu

    @property
    def bandwidth(self) -> float:
        return self.gpus * self.spec.hbm_tb_s * 1e12 * self.mbu

    def free_bytes(self, model: ModelSpec) -> float:
        """Memory left for KV and states once the weights are loaded."""
        mem_gb = self.spec.mem_gb if self.measured is None else \
            float(self.measured.get("mem_gb", self.spec.mem_gb))
        total = self.gpus * mem_gb * 1e9 * (1 - self.mem_reserve)
        return total - model.weight_bytes

    def label(self) -> str:
        return f"{self.gpus}x{self.gpu}"


def step_time(prof: InstanceProfile, model: ModelSpec, chunks: list[tuple[int, int]],
              decode_ctx: list[int] | int, n_decode: int | None = None) -> float:
    """Seconds of one engine step: prefill ``chunks`` [(start, num_tokens)] + a decode batch.

    ``decode_ctx`` is the context length of every decoding sequence, or their sum (then
    ``n_decode`` gives their number).
    """
    if isinstance(decode_ctx, int):
        ctx_sum, n_dec = decode_ctx, n_decode or 0
    else:
        ctx_sum, n_dec = sum(decode_ctx), len(decode_ctx)
    n_pre = sum(n for _, n in chunks)
    if prof.measured is not None:
        return _measured_step(prof.measured, n_pre, n_dec, ctx_sum)
    tokens = n_pre + n_dec
    if tokens == 0:
        return 0.0
    pairs = ctx_sum + sum(s * n + n * (n + 1) / 2 for s, n in chunks)
    flops = (2 * model.active_params + model.linear_token_flops) * tokens \
        + model.attn_pair_flops * pairs
    f = model.active_params / model.total_params
    touched = 1.0 if f >= 1 else -math.expm1(tokens * math.log1p(-f))
    kv_read = model.kv_bytes_per_token * (ctx_sum + sum(s + n for s, n in chunks))
    nbytes = model.weight_bytes * touched + kv_read \
        + 2 * model.state_bytes * (n_dec + len(chunks))
    return max(flops / prof.flops, nbytes / prof.bandwidth) + prof.step_overhead_s


def _measured_step(m: dict, n_pre: int, n_dec: int, ctx_sum: int = 0) -> float:
    t = 0.0
    if n_pre:
        # a prefill forward pass has a fixed cost (per-layer launches, sampling) beside
        # its per-token cost; small models on a CPU are dominated by it
        t += float(m.get("prefill_overhead_s", 0.0)) + n_pre / m["prefill_tok_s"]
    if n_dec:
        table = {int(k): float(v) for k, v in m["decode_step_s"].items()}
        widths = sorted(table)
        lo = max([w for w in widths if w <= n_dec], default=widths[0])
        hi = min([w for w in widths if w >= n_dec], default=widths[-1])
        if hi == lo:
            t += table[lo] * (n_dec / lo if n_dec > lo else 1.0)
        else:
            t += table[lo] + (table[hi] - table[lo]) * (n_dec - lo) / (hi - lo)
        # the table holds steps at decode_context tokens a sequence; longer contexts cost
        # decode_ctx_s a token more (attention reads them)
        extra = ctx_sum - n_dec * int(m.get("decode_context", 0))
        t += max(0.0, extra) * float(m.get("decode_ctx_s", 0.0))
    return t + float(m.get("step_overhead_s", 0.0))


def load_measured_profile(path: str | pathlib.Path) -> InstanceProfile:
    """An instance profile measured on hyla's own engine, from JSON.

    Format (what ``hyla profile`` writes, :func:`hyla.disagg.sim.profile.measure_engine_profile`)::

        {"name": "cpu-2core", "preset": "small",
         "prefill_tok_s": 5200.0,                      # prompt tokens per second
         "prefill_overhead_s": 0.004,                  # optional: fixed cost of a prefill step
         "decode_step_s": {"1": 0.011, "8": 0.019, "32": 0.05},  # step time by batch width
         "decode_context": 32,                         # optional: their tokens a sequence
         "decode_ctx_s": 2e-7,                         # optional: + seconds a context token
         "step_overhead_s": 0.0,                       # optional
         "mem_gb": 16.0}                               # optional, memory for KV/state
    """
    try:
        data = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:     # a GGUF, a binary: not a profile
        raise ValueError(f"measured profile {path} is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"measured profile {path} must be a JSON object, got "
                         f"{type(data).__name__}")
    for key in ("prefill_tok_s", "decode_step_s"):
        if key not in data:
            raise ValueError(f"measured profile {path} lacks {key!r}")
    if not data["decode_step_s"] or float(data["prefill_tok_s"]) <= 0:
        raise ValueError(f"measured profile {path}: need prefill_tok_s > 0 and decode_step_s")
    if float(data.get("prefill_overhead_s", 0.0)) < 0:
        raise ValueError(f"measured profile {path}: prefill_overhead_s must be >= 0")
    return InstanceProfile(gpu="H20", gpus=1, measured=data)


def kv_gbps(prof: InstanceProfile, model: ModelSpec, tokens: int = 32_768,
            include_state: bool = True) -> float:
    """Gbps of KV (and state) a prefill instance emits, prefilling ``tokens``-token prompts
    back to back (one prompt a step)."""
    t = step_time(prof, model, [(0, tokens)], 0)
    nbytes = model.transfer_bytes(tokens) if include_state else model.kv_bytes_per_token * tokens
    return nbytes * 8 / t / 1e9

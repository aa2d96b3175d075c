"""The options of the gated delta rule layers ``D`` and ``K``
(``cfg.mixer_options["gated_delta"]`` / ``["kda"]``): the shapes and variants of the linear
layers the transformers families ship, each mapped onto one layer implementation
(:mod:`hyla.model.mixers.deltanet`)."""

from __future__ import annotations

from dataclasses import dataclass

CONV_KERNEL = 4


@dataclass(frozen=True)
class DeltaOptions:
    """Options of the ``D`` and ``K`` layers (``cfg.mixer_options["gated_delta"]``,
    ``["kda"]``); the defaults are hyla's own layer.

    Which transformers module each option serves (weights map one to one unless noted):

    - ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet`` (``D``): ``num_k_heads`` =
      linear_num_key_heads, ``num_v_heads`` = linear_num_value_heads, ``head_k_dim`` /
      ``head_v_dim`` = linear_key/value_head_dim, ``conv_kernel`` = linear_conv_kernel_dim;
      ``o_norm_eps`` None (rms_norm_eps is ``cfg.norm_eps``). Qwen3-Next's fused
      ``in_proj_qkvz`` / ``in_proj_ba`` are interleaved per key-head group; the family
      splits them into q/k/v/g and b/a (``hyla.model.formats.families.qwen3_next``).
      ``conv1d`` -> ``conv``, ``norm`` -> ``o_norm``, ``out_proj`` -> ``o_proj``, z -> ``g_proj``.
    - ``OlmoHybridGatedDeltaNet`` (``D``): as Qwen3.5, plus ``beta_scale=2.0`` when
      linear_allow_neg_eigval, and ``o_norm_eps=1e-5`` (its gated norm's eps is fixed);
      q/k/v/a/b/g/o_proj and ``o_norm`` keep their names, ``conv1d`` -> ``conv``.
    - ``KimiLinearDeltaAttention`` (``K``): ``num_k_heads`` = linear_num_heads (values
      the same), ``head_k_dim = head_v_dim`` = linear_head_dim, ``decay_rank`` =
      ``gate_rank`` = linear_head_dim (``forget_gate.f_a_proj`` -> ``a_down``,
      ``f_b_proj`` -> ``a_proj``; ``g_a_proj`` -> ``g_down``, ``g_b_proj`` -> ``g_proj``),
      ``gate_act="sigmoid"``; ``forget_gate.A_log`` [1, 1, H, 1] -> ``A_log`` [H],
      ``forget_gate.dt_bias`` -> ``dt_bias`` [H * head_k_dim]; the one ``conv1d`` over
      q|k|v -> ``conv`` (the original checkpoints' q/k/v_conv1d concatenate into it).
    - ``BailingHybridDeltaAttention`` (Ring-2.5, ``K``): as Kimi but full-rank gates
      (``decay_rank = gate_rank = None``: ``forget_gate.f_proj`` -> ``a_proj``,
      ``g_proj`` -> ``g_proj``), ``safe_gate`` = kda_safe_gate, ``lower_bound`` =
      kda_lower_bound; ``forget_gate.A_log`` [H] -> ``A_log``.

    Options:
        num_k_heads: q/k heads (None: ``cfg.n_heads``).
        num_v_heads: value heads = state heads (None: ``num_k_heads``), a multiple of
            ``num_k_heads``; q and k are repeated for each value head of their group
            (value head ``h`` reads key head ``h // (num_v_heads / num_k_heads)``).
        head_k_dim, head_v_dim: per-head dims (None: ``cfg.head_k_dim``, ``cfg.head_v_dim``).
        conv_kernel: the short convolution's width (taps).
        decay_rank: None: ``a_proj`` maps d_model to the decays; r: ``a_proj(a_down(x))``
            through rank r (Kimi's low-rank forget gate).
        safe_gate: the decay is ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``
            instead of ``-exp(A_log) * softplus(a + dt_bias)`` (Ring-2.5's kda_safe_gate).
        lower_bound: the most negative log decay with ``safe_gate`` (< 0).
        beta_scale: beta = beta_scale * sigmoid(b); 2.0 lets the delta rule's eigenvalues
            go negative (OLMo hybrid's linear_allow_neg_eigval).
        gate_rank: None: ``g_proj`` maps d_model to the output gate; r: ``g_proj(g_down(x))``.
        gate_act: the output gate's activation, "silu" (Gated DeltaNet) or "sigmoid" (KDA).
        o_norm_eps: the output norm's eps (None: ``cfg.norm_eps``).

    Example:
        >>> from hyla.model.config import HylaConfig
        >>> from hyla.model.mixers import GatedDeltaMixer
        >>> cfg = HylaConfig(vocab_size=256, d_model=64, layers="D", n_heads=4, ffn_dim=128,
        ...                  mixer_options={"gated_delta": {"num_k_heads": 2,
        ...                                                 "num_v_heads": 4}})
        >>> GatedDeltaMixer.state_spec(cfg).fixed[0].shape
        (4, 8, 16)
    """

    num_k_heads: int | None = None
    num_v_heads: int | None = None
    head_k_dim: int | None = None
    head_v_dim: int | None = None
    conv_kernel: int = CONV_KERNEL
    decay_rank: int | None = None
    safe_gate: bool = False
    lower_bound: float = -5.0
    beta_scale: float = 1.0
    gate_rank: int | None = None
    gate_act: str = "silu"
    o_norm_eps: float | None = None

    def __post_init__(self):
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "decay_rank",
                     "gate_rank"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive int or None, got {value}")
        if self.conv_kernel < 1:
            raise ValueError(f"conv_kernel must be >= 1, got {self.conv_kernel}")
        if self.gate_act not in ("silu", "sigmoid"):
            raise ValueError(f"gate_act must be 'silu' or 'sigmoid', got {self.gate_act!r}")
        if not self.lower_bound < 0:
            raise ValueError(f"lower_bound must be < 0 (a log decay), got {self.lower_bound}")


def delta_dims(cfg, opts: DeltaOptions) -> tuple[int, int, int, int]:
    """(num_k_heads, num_v_heads, head_k_dim, head_v_dim) of a layer under ``cfg``."""
    hk = opts.num_k_heads or cfg.n_heads
    hv = opts.num_v_heads or hk
    if hv % hk:
        raise ValueError(f"mixer_options: num_v_heads={hv} must be a multiple of "
                         f"num_k_heads={hk}")
    return hk, hv, opts.head_k_dim or cfg.head_k_dim, opts.head_v_dim or cfg.head_v_dim

"""Model configuration: one dataclass, presets as plain functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from hyla.model.ffn import FFNS
from hyla.model.field_checks import MAX_LAYERS, check_fields  # noqa: F401 - re-exported
from hyla.model.layers import check_rope_scaling
from hyla.model.mixers import MIXERS
from hyla.ops.gla.chunk import CHUNK_SIZES


@dataclass(kw_only=True)
class HylaConfig:
    """Shape of a hybrid GLA / softmax-attention language model.

    ``layers`` is the layer mix, one letter a layer, each a registered mixer
    (:data:`hyla.model.mixers.MIXERS`): ``G`` gated linear attention, ``A`` softmax attention
    (rotary, grouped-query). GLA layers use no positional encoding.

    Example:
        >>> cfg = HylaConfig(vocab_size=256, d_model=64, layers="GGGA", n_heads=4, ffn_dim=128)
        >>> cfg.n_layers, cfg.head_k_dim, cfg.head_v_dim
        (4, 8, 16)
    """

    vocab_size: int
    d_model: int
    layers: str
    n_heads: int
    ffn_dim: int
    n_kv_heads: int | None = None  # attention layers only; None means n_heads (no GQA)
    expand_k: float = 0.5  # GLA key dim = d_model * expand_k (flash-linear-attention default)
    expand_v: float = 1.0
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float = 16.0
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    chunk_size: int = 64
    initializer_range: float = 0.02
    # Attention layers, as the transformers families hyla loads have them; the defaults are
    # hyla's own attention (and leave a model without them unchanged).
    attention_head_dim: int | None = None   # None: d_model // n_heads (Qwen3 sets its own)
    attention_bias: bool = False            # q/k/v projection biases (Qwen2, Llama's option)
    attention_out_bias: bool = False        # o_proj bias (Llama's attention_bias)
    qk_norm: bool = False                   # RMSNorm per head on q and k before rotary (Qwen3)
    rope_scaling: dict | None = None        # scaled RoPE: hyla.model.layers.rope_frequencies
    sliding_window: int | None = None       # attention sees the last `sliding_window` tokens
    # Linearised attention (distillation students): a G layer with linear_window > 0 keeps
    # the teacher's q/k/v/o, attends exactly to its last `linear_window` tokens and first
    # `window_sinks` tokens, and mixes that with a normalised GLA branch over Hedgehog
    # feature maps (hyla.model.mixers.linearised.gla). 0: plain GLA.
    linear_window: int = 0
    window_sinks: int = 4
    # The feed-forward half of each block, one letter a layer from hyla.model.ffn.FFNS ("S"
    # dense SwiGLU of ffn_dim, "E" mixture of experts); None: "S" everywhere.
    ffn_layers: str | None = None
    # Options of a layer kind the fields above do not cover, by its kind name: each mixer
    # (mixer_options) and FFN (ffn_options) reads and validates its own, e.g.
    # {"moe": {"num_experts": 8, "top_k": 2, ...}}.
    mixer_options: dict = field(default_factory=dict)
    ffn_options: dict = field(default_factory=dict)
    # Per-layer values of any field above (a list of n_layers dicts, {} where none): models
    # whose layers of one kind differ (MiMo-V2-Flash's window layers have their own heads and
    # rope theta). Options dicts merge per kind. Read through layer_config(i).
    layer_overrides: list | None = None
    # Norm weights stored zero-centred, applied as (1 + w) (Qwen3-Next, Qwen3.5).
    norm_zero_centred: bool = False
    # "pre": x + f(norm(x)); "post": x + norm(f(x)) (OLMo's attention blocks).
    norm_placement: str = "pre"
    # Constant factors some families train with (Granite's muP-style multipliers): the
    # embedding's output, every mixer's and FFN's output before its residual add, and the
    # logits (1 / Granite's logits_scaling). 1.0: none.
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    # Multi-token-prediction layers (hyla.model.mtp): a checkpoint's next-next-token heads,
    # each a block like the stack's last softmax-attention layer; they draft tokens for
    # speculative decoding (--speculative mtp) and take no part in the model's own forward.
    mtp_layers: int = 0
    # How they are built (hyla.model.mtp.mtp_config), where the checkpoint's differ from
    # Qwen3-Next's: "like", the index of the stack layer whose config they copy (default:
    # the last 'A'); "ffn", their FFN letter (default: that layer's); "per_layer_fusion",
    # each MTP layer with its own fusion and final norm (DeepSeek's and MiMo-V2-Flash's
    # layout) rather than one for all (Qwen3-Next's).
    mtp_options: dict = field(default_factory=dict)
    # The transformers model_type a model was loaded from, which export writes back; None
    # for hyla's own models. hf_extras: fields of its config.json that do not change what
    # the model computes but that other engines read (max_position_embeddings, the special
    # token ids), written back unchanged.
    family: str | None = None
    hf_extras: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        check_fields(self.__dict__, {f.name: f.type for f in dataclasses.fields(self)})
        for name in ("vocab_size", "d_model", "n_heads", "ffn_dim", "gate_low_rank_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.layers, str) or not self.layers:
            raise ValueError(f"layers must be a non-empty string of {sorted(MIXERS)}, "
                             f"got {self.layers!r}")
        bad = sorted({c for c in self.layers if c not in MIXERS})
        if bad:
            known = ", ".join(f"'{k}' ({m.kind})" for k, m in sorted(MIXERS.items()))
            raise ValueError(f"layers has unknown letter(s) {bad}: expected only {known}, "
                             f"got {self.layers!r}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads must divide n_heads={self.n_heads}, "
                             f"got {self.n_kv_heads}")
        for name in ("attention_head_dim", "sliding_window"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.attention_head_dim is not None and self.attention_head_dim % 2:
            raise ValueError(f"attention_head_dim must be even (rotary pairs), "
                             f"got {self.attention_head_dim}")
        check_rope_scaling(self.rope_scaling)
        for name in ("linear_window", "window_sinks", "mtp_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        for name, dim in (("expand_k", self.key_dim), ("expand_v", self.value_dim)):
            if dim <= 0 or dim % self.n_heads or dim != getattr(self, name) * self.d_model:
                raise ValueError(f"{name}={getattr(self, name)} must make d_model*{name} a "
                                 f"positive multiple of n_heads={self.n_heads}")
        if self.chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {self.chunk_size}")
        if self.gate_logit_normalizer <= 0:
            raise ValueError(f"gate_logit_normalizer must be > 0, got {self.gate_logit_normalizer}")
        self._check_layer_fields()
        if self.mtp_layers and "A" not in self.layers:
            raise ValueError(f"mtp_layers={self.mtp_layers} needs a softmax-attention layer "
                             f"('A') to copy, got layers {self.layers!r}")
        self._check_mtp_options()

    def _check_mtp_options(self) -> None:
        o = self.mtp_options
        if not isinstance(o, dict) or set(o) - {"like", "ffn", "per_layer_fusion"}:
            raise ValueError(f"mtp_options must be a dict of some of 'like', 'ffn', "
                             f"'per_layer_fusion', got {o!r}")
        like = o.get("like")       # (an attention block built from that layer's fields)
        if like is not None and (not isinstance(like, int) or isinstance(like, bool)
                                 or not 0 <= like < self.n_layers):
            raise ValueError(f"mtp_options['like'] must index one of the {self.n_layers} "
                             f"layers, got {like!r}")
        if "ffn" in o and o["ffn"] not in FFNS:
            raise ValueError(f"mtp_options['ffn'] must be one of {sorted(FFNS)}, "
                             f"got {o['ffn']!r}")
        if not isinstance(o.get("per_layer_fusion", False), bool):
            raise ValueError(f"mtp_options['per_layer_fusion'] must be a bool, "
                             f"got {o['per_layer_fusion']!r}")

    def _check_layer_fields(self) -> None:
        if self.ffn_layers is not None:
            if not isinstance(self.ffn_layers, str) or len(self.ffn_layers) != self.n_layers:
                raise ValueError(f"ffn_layers must be a string of {self.n_layers} letters "
                                 f"(one a layer) or None, got {self.ffn_layers!r}")
            bad = sorted({c for c in self.ffn_layers if c not in FFNS})
            if bad:
                raise ValueError(f"ffn_layers has unknown letter(s) {bad}: expected only "
                                 f"{sorted(FFNS)}, got {self.ffn_layers!r}")
        if self.norm_placement not in ("pre", "post"):
            raise ValueError(f"norm_placement must be 'pre' or 'post', "
                             f"got {self.norm_placement!r}")
        for name, registry in (("mixer_options", MIXERS), ("ffn_options", FFNS)):
            options = getattr(self, name)
            kinds = {cls.kind for cls in registry.values()}
            if not isinstance(options, dict) or not all(
                    isinstance(v, dict) for v in options.values()):
                raise ValueError(f"{name} must be a dict of dicts by layer kind, got {options!r}")
            unknown = sorted(set(options) - kinds)
            if unknown:
                raise ValueError(f"{name} has unknown layer kind(s) {unknown}: expected some "
                                 f"of {sorted(kinds)}")
        overrides = self.layer_overrides
        if overrides is not None:
            if not isinstance(overrides, list | tuple) or len(overrides) != self.n_layers \
                    or not all(isinstance(o, dict) for o in overrides):
                raise ValueError(f"layer_overrides must be a list of {self.n_layers} dicts "
                                 f"(one a layer), got {overrides!r}")
            self.layer_overrides = [dict(o) for o in overrides]
            allowed = {f.name for f in dataclasses.fields(self)} - _GLOBAL_FIELDS
            for i, o in enumerate(self.layer_overrides):
                bad = sorted(set(o) - allowed)
                if bad:
                    raise ValueError(f"layer_overrides[{i}] has field(s) {bad} that cannot "
                                     f"differ by layer: expected some of {sorted(allowed)}")
        self._layer_cfgs: dict[int, HylaConfig] = {}
        for i in range(self.n_layers):     # every layer's fields and options are valid
            cfg = self.layer_config(i)
            MIXERS[self.layers[i]].check_config(cfg)
            FFNS[self.ffn_letter(i)].check_config(cfg)

    def layer_config(self, i: int) -> HylaConfig:
        """The config layer ``i`` is built from: this one with ``layer_overrides[i]``
        applied (options dicts merged per kind). What a mixer, an FFN and a StateSpec see.

        Example:
            >>> cfg = HylaConfig(vocab_size=256, d_model=64, layers="AA", n_heads=4,
            ...                  ffn_dim=128, layer_overrides=[{}, {"sliding_window": 8}])
            >>> cfg.layer_config(0).sliding_window, cfg.layer_config(1).sliding_window
            (None, 8)
        """
        if not self.layer_overrides or not self.layer_overrides[i]:
            return self
        if i not in self._layer_cfgs:
            o = dict(self.layer_overrides[i])
            for name in ("mixer_options", "ffn_options"):
                if name in o:
                    merged = {k: dict(v) for k, v in getattr(self, name).items()}
                    for kind, values in o[name].items():
                        merged[kind] = {**merged.get(kind, {}), **values}
                    o[name] = merged
            self._layer_cfgs[i] = dataclasses.replace(self, layer_overrides=None, **o)
        return self._layer_cfgs[i]

    def ffn_letter(self, i: int) -> str:
        """The FFN kind letter of layer ``i`` (``"S"`` when ``ffn_layers`` is None)."""
        return "S" if self.ffn_layers is None else self.ffn_layers[i]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def key_dim(self) -> int:
        return int(self.d_model * self.expand_k)

    @property
    def value_dim(self) -> int:
        return int(self.d_model * self.expand_v)

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.n_heads

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.n_heads

    @property
    def head_dim(self) -> int:
        """Head dim of the attention layers."""
        return self.attention_head_dim or self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of one attention layer's keys (and of its values)."""
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __getstate__(self) -> dict:       # the per-layer cache is rebuilt, never pickled
        return {k: v for k, v in self.__dict__.items() if k != "_layer_cfgs"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._layer_cfgs = {}


# Fields that shape the whole model and so cannot differ by layer.
_GLOBAL_FIELDS = {"vocab_size", "d_model", "layers", "ffn_layers", "layer_overrides",
                  "mtp_layers", "mtp_options",
                  "tie_embeddings", "family", "hf_extras", "initializer_range",
                  "norm_zero_centred", "embedding_scale", "logit_scale"}


def debug() -> HylaConfig:
    """Tiny hybrid for tests: byte vocabulary, 4 layers (3 GLA + 1 GQA attention)."""
    return HylaConfig(vocab_size=256, d_model=64, layers="GGGA", n_heads=4, n_kv_heads=2,
                      ffn_dim=128, chunk_size=16)


def small() -> HylaConfig:
    """About 20M parameters: trains on a laptop CPU in minutes. 8 layers, 1 attention in 4."""
    return HylaConfig(vocab_size=8192, d_model=384, layers="GGGA" * 2, n_heads=6, ffn_dim=1024)


def with_moe(cfg: HylaConfig, expert_dim: int) -> HylaConfig:
    """``cfg`` with every FFN a mixture of experts: 8 routed experts of ``expert_dim``, top-2,
    one always-on shared expert of the same width, DeepSeek-V3's router (sigmoid scores,
    top-2 weights renormalised) and its auxiliary-loss-free balancing: ``score_bias`` moves
    by 1e-3 a step towards uniform load (:mod:`hyla.train.routing`). Why not a Switch-style
    auxiliary loss: no gradient competes with the LM loss, and the bias is a buffer updated
    from integer counts summed over the ranks, so every rank applies the same update and
    diloco/fomoe's outer step (parameters only) never has to average it."""
    moe = {"num_experts": 8, "top_k": 2, "expert_dim": expert_dim, "shared_dim": expert_dim,
           "router": "sigmoid", "score_bias": True, "norm_topk": True, "balance_rate": 1e-3}
    return dataclasses.replace(cfg, ffn_layers="E" * cfg.n_layers, ffn_options={"moe": moe})


def debug_moe() -> HylaConfig:
    """``debug`` with MoE FFNs (:func:`with_moe`, experts 40 wide): 378,064 parameters,
    193,744 active a token (debug: 197,840). Seconds a step on a CPU."""
    return with_moe(debug(), 40)


def small_moe() -> HylaConfig:
    """``small`` with MoE FFNs (:func:`with_moe`, experts 336 wide, so 2 routed + 1 shared
    expert are about small's 1024-wide SwiGLU): 38,967,168 parameters, 20,387,712 active a
    token (small: 20,510,592), at vocab 8192.

    Example:
        >>> from hyla.model.sizing import parameter_counts
        >>> n = parameter_counts(small_moe())
        >>> n["total"], n["active"], n["moe_layers"]
        (38967168, 20387712, 8)
    """
    return with_moe(small(), 336)


def debug_ssm() -> HylaConfig:
    """``debug`` with Mamba-2 (``S``) and LFM2 short-convolution (``C``) layers around one
    attention layer: SSM state heads of 16 channels, state size 16."""
    return dataclasses.replace(debug(), layers="SCSA", mixer_options={
        "mamba2": {"head_dim": 16, "state_size": 16, "n_groups": 2}})


def small_ssm() -> HylaConfig:
    """``small``'s shape as a Granite-4.0-H-style hybrid: Mamba-2 layers (expand 2, heads of
    64 channels, state 128, one group) with one attention layer in four."""
    return dataclasses.replace(small(), layers="SSSA" * 2)


def laplace_3b() -> HylaConfig:
    """The reference 3B GLA model: 24 GLA layers, d_model 3072, about 3.03B parameters.

    How the numbers were chosen:
    - 24 layers at d_model 3072, all GLA (the reference run trained a pure GLA model);
    - 16 heads with flash-linear-attention's GLA defaults expand_k=0.5, expand_v=1, so each
      head keeps a 96 x 192 fp32 state: 16*96*192*4 B = 1.18 MB a layer, 28.3 MB a sequence
      (the published figure is 29.5 MB), about 85x less than the bf16 KV cache of a 24-layer
      multi-head attention model of the same width at 8192 tokens (2.42 GB; published ~82x);
    - SwiGLU width 8192 = 8/3 * d_model, the usual 4x-MLP-equivalent;
    - vocabulary 50304 (GPT-2's, padded to a multiple of 128), untied input and output
      embeddings, which brings the total to 3.03B.
    """
    return HylaConfig(vocab_size=50304, d_model=3072, layers="G" * 24, n_heads=16, ffn_dim=8192)


PRESETS: dict[str, Callable[[], HylaConfig]] = {
    "debug": debug,
    "small": small,
    "debug-moe": debug_moe,
    "small-moe": small_moe,
    "debug-ssm": debug_ssm,
    "small-ssm": small_ssm,
    "laplace-3b": laplace_3b,
}


def preset(name: str) -> HylaConfig:
    """Return a fresh config for a named preset.

    Example:
        >>> preset("debug").layers
        'GGGA'
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: expected one of {sorted(PRESETS)}")
    return PRESETS[name]()

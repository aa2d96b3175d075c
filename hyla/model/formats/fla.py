"""flash-linear-attention GLA directories in and out (``model_type: "gla"``, ``GLAForCausalLM``).

An fla GLA directory holds ``config.json`` (fla's ``GLAConfig``; its ``attn`` block makes the
listed layers softmax attention), safetensors weights named as ``GLAForCausalLM``'s state dict
and ``tokenizer.json``. Reading needs no ``fla``: the config is JSON, the weights safetensors.
Writing produces a directory that ``transformers`` loads after ``import fla``.

How fla 0.6's model maps onto hyla (``G`` for a GLA layer, ``A`` for an ``attn`` layer):

- GLA: q/k/v/g projections, the rank-16 ``gk_proj`` with ``logsigmoid(.) / 16`` (fla's
  ``GLABlock`` passes neither ``gate_logit_normalizer`` nor ``gate_low_rank_dim``: they are
  always 16), RMSNorm per head times ``swish(g_proj(x))``. ``fuse_norm`` only picks the module
  (``g_norm_swish_gate`` or ``g_norm``): both names load; export writes the fused one, fla's
  default. ``elementwise_affine: false`` loads as a norm weight of ones. GLA ``num_kv_heads``
  loads exactly by repeating k, v and the gate rows of each KV head for its query heads;
  export writes one KV head per head. ``attn_mode`` picks a kernel of the same function.
- attention: the ``attn`` block's ``num_heads`` must equal ``num_heads`` (hyla has one head
  count); ``num_kv_heads``, ``rope_theta``, ``qkv_bias`` and ``window_size`` must agree across
  ``attn`` specs. Rotary is the same half-split layout with ``theta ** (-2i / D)``;
  ``qkv_bias`` is ``attention_bias`` (q/k/v; fla's o_proj has none) and ``window_size`` is
  ``sliding_window`` (both: the last ``window`` tokens, the query's own included).
- blocks: pre-norm RMSNorm (one ``norm_eps`` for every norm, as fla), SwiGLU MLP
  (``intermediate_size``, or fla's rule from ``hidden_ratio``), final norm, tied or untied head.
- refused, ``ValueError`` naming the file and the field: ``feature_map``, ``use_short_conv``,
  ``use_output_gate: false``, ``clamp_min``, ``hidden_act`` other than ``swish``,
  ``attnres_block_size``, ``use_gk: false``, ``use_gv: true``, a ``gate_logit_normalizer`` or
  ``gate_low_rank_dim`` other than 16, unknown ``attn`` keys, and any tensor hyla would not
  use. Export refuses layer kinds other than GLA and attention, a normaliser or gate rank
  other than 16, and any other hyla config field away from its default (an o_proj bias,
  q/k norms, scaled RoPE, an attention head dim other than ``d_model / n_heads``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from hyla.model.config import HylaConfig
from hyla.model.formats.hf.tokenizer import load_hf_tokenizer, save_hf_tokenizer
from hyla.model.formats.hf.weights import read_safetensors
from hyla.model.mixers import MIXERS, AttentionMixer, GLAMixer
from hyla.model.mixers.base import expand_kv_heads
from hyla.model.model import HylaLM

MODEL_TYPE = "gla"                   # GLAConfig.model_type
FIXED_GATE = 16                      # fla's GLA gate_logit_normalizer and gate_low_rank_dim
_ATTN_KEYS = {"layers", "num_heads", "num_kv_heads", "qkv_bias", "window_size", "rope_theta"}
_ATTN_SHARED = {"num_kv_heads": "n_kv_heads", "rope_theta": "rope_theta",   # attn -> hyla
                "qkv_bias": "attention_bias", "window_size": "sliding_window"}
# fla fields that must hold these values (fla's defaults) for hyla to compute the same thing
_REQUIRED = {"feature_map": None, "use_short_conv": False, "use_output_gate": True,
             "clamp_min": None, "hidden_act": "swish", "attnres_block_size": None,
             "use_gk": True, "use_gv": False,
             "gate_logit_normalizer": FIXED_GATE, "gate_low_rank_dim": FIXED_GATE}
# hyla config fields export_fla writes (or checks); any other one must keep its default
_EXPORTED = {"vocab_size", "d_model", "layers", "n_heads", "ffn_dim", "n_kv_heads", "expand_k",
             "expand_v", "norm_eps", "rope_theta", "tie_embeddings", "initializer_range",
             "chunk_size", "gate_low_rank_dim", "gate_logit_normalizer", "attention_bias",
             "sliding_window"}


@dataclass(frozen=True)
class _LayerFormat:
    """How one hyla mixer kind is stored under ``model.layers.<i>.attn.`` in fla: every
    parameter under its hyla name unless renamed."""

    renames: dict[str, str] = dataclasses.field(default_factory=dict)
    grouped: frozenset[str] = frozenset()        # rows per KV head in fla (GLA num_kv_heads)


_FORMATS = {
    GLAMixer: _LayerFormat(renames={"g_norm.weight": "g_norm_swish_gate.weight"},
                           grouped=frozenset({"k_proj.weight", "v_proj.weight",
                                              "gk_proj.1.weight", "gk_proj.1.bias"})),
    AttentionMixer: _LayerFormat(),
}
_UNFUSED = {"g_norm_swish_gate.weight": "g_norm.weight"}     # fuse_norm: false
_TOP = {"embed.weight": "model.embeddings.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}


@dataclass(frozen=True)
class _FlaLayout:
    """What the weights look like beyond the HylaConfig: needed to rename them."""

    gla_kv_heads: int
    fuse_norm: bool
    norm_weights: bool          # elementwise_affine


def is_fla_dir(path: str | os.PathLike) -> bool:
    """True when ``path/config.json`` is a flash-linear-attention GLA config.

    Example:
        >>> import tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "config.json").write_text('{"model_type": "gla"}')
        >>> is_fla_dir(d), is_fla_dir(d / "missing")
        (True, False)
    """
    cfg = pathlib.Path(path) / "config.json"
    try:
        value = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(value, dict) and value.get("model_type") == MODEL_TYPE


def fla_config_to_hyla(fla: dict, source: str = "config.json") -> tuple[HylaConfig, _FlaLayout]:
    """Translate an fla ``GLAConfig`` dict into a :class:`HylaConfig` (``G`` and ``A`` layers).

    Example:
        >>> cfg, _ = fla_config_to_hyla({"model_type": "gla", "vocab_size": 300,
        ...     "hidden_size": 64, "num_heads": 4, "num_hidden_layers": 3,
        ...     "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2}})
        >>> cfg.layers, cfg.n_kv_heads, cfg.ffn_dim, cfg.gate_logit_normalizer
        ('GAG', 2, 256, 16.0)
    """
    if fla.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{source}: model_type {fla.get('model_type')!r} is not supported: "
                         f"expected {MODEL_TYPE!r} (flash-linear-attention GLA)")
    for field, want in _REQUIRED.items():
        got = fla.get(field, want)
        if got != want:
            raise ValueError(f"{source}: {field}={got!r} is not supported: hyla's GLA layer "
                             f"needs {field}={want!r} ({_WHY[field]})")
    try:
        d, heads = int(fla["hidden_size"]), int(fla["num_heads"])
        n_layers, vocab = int(fla["num_hidden_layers"]), int(fla["vocab_size"])
    except KeyError as e:
        raise ValueError(f"{source} has no {e.args[0]!r}: expected a complete GLA config") from None
    attn_layers, attention = _attention_spec(fla.get("attn"), heads, n_layers, source)
    gla_kv = fla.get("num_kv_heads") or heads
    if heads % gla_kv:
        raise ValueError(f"{source}: num_kv_heads={gla_kv} must divide num_heads={heads}")
    letters = [AttentionMixer.letter if i in attn_layers else GLAMixer.letter
               for i in range(n_layers)]
    try:
        cfg = HylaConfig(
            vocab_size=vocab, d_model=d, layers="".join(letters), n_heads=heads,
            ffn_dim=_ffn_dim(fla, d), expand_k=float(fla.get("expand_k", 0.5)),
            expand_v=float(fla.get("expand_v", 1.0)), gate_low_rank_dim=FIXED_GATE,
            gate_logit_normalizer=float(FIXED_GATE), norm_eps=float(fla.get("norm_eps", 1e-6)),
            tie_embeddings=bool(fla.get("tie_word_embeddings", False)),
            initializer_range=float(fla.get("initializer_range", 0.02)), **attention)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: {e}") from e
    layout = _FlaLayout(gla_kv_heads=int(gla_kv), fuse_norm=bool(fla.get("fuse_norm", True)),
                        norm_weights=bool(fla.get("elementwise_affine", True)))
    return cfg, layout


_WHY = {
    "feature_map": "hyla applies no feature map to q and k",
    "use_short_conv": "hyla's GLA layer has no short convolution",
    "use_output_gate": "hyla's GLA layer always gates its output",
    "clamp_min": "hyla does not clamp the log forget gates",
    "hidden_act": "hyla's output gate and MLP use swish",
    "attnres_block_size": "hyla's blocks add plain residuals",
    "use_gk": "hyla's GLA layer always has per-key forget gates",
    "use_gv": "hyla's GLA layer has no value gates",
    "gate_logit_normalizer": "fla's GLABlock always builds its layer with 16",
    "gate_low_rank_dim": "fla's GLABlock always builds its layer with 16",
}


def _attention_spec(attn, heads: int, n_layers: int, source: str) -> tuple[set, dict]:
    """(attention layer indices, their HylaConfig fields) from fla's ``attn`` block."""
    if attn is None:
        return set(), {}
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise ValueError(f"{source}: attn must be null, an object or a list of objects, got "
                         f"{attn!r}")
    layers, shared = set(), {name: set() for name in _ATTN_SHARED}
    for s in specs:
        unknown = sorted(set(s) - _ATTN_KEYS)
        if unknown:
            raise ValueError(f"{source}: attn has unsupported key(s) {unknown}: expected only "
                             f"{sorted(_ATTN_KEYS)}")
        if s.get("num_heads") != heads:
            raise ValueError(f"{source}: attn.num_heads={s.get('num_heads')!r} is not "
                             f"supported: hyla's attention layers use num_heads={heads}")
        bad = [i for i in s.get("layers", []) if not isinstance(i, int) or not 0 <= i < n_layers]
        if bad or not isinstance(s.get("layers"), list):
            raise ValueError(f"{source}: attn.layers={s.get('layers')!r} must list layer "
                             f"indices in [0, {n_layers})")
        layers |= set(s["layers"])
        spec = {"num_kv_heads": heads, "rope_theta": 10000.0, "qkv_bias": False,
                "window_size": None} | {k: v for k, v in s.items() if v is not None}
        for name, values in shared.items():
            values.add(spec[name])
    fields = {}
    for name, values in shared.items():
        if len(values) > 1:
            raise ValueError(f"{source}: attn specs disagree on {name} ({sorted(values, key=str)}"
                             f"): hyla's attention layers share one")
        fields[_ATTN_SHARED[name]] = values.pop()
    fields["rope_theta"] = float(fields["rope_theta"])
    fields["attention_bias"] = bool(fields["attention_bias"])
    return layers, fields


def _ffn_dim(fla: dict, d: int) -> int:
    """fla's GatedMLP width: ``intermediate_size``, else 2/3 * hidden_ratio * d rounded up to
    a multiple of 256."""
    if fla.get("intermediate_size") is not None:
        return int(fla["intermediate_size"])
    ratio = fla.get("hidden_ratio") or 4
    return 256 * math.ceil(int(d * ratio * 2 / 3) / 256)


def _fla_names(cfg: HylaConfig, layout: _FlaLayout) -> dict[str, tuple[str, bool, tuple]]:
    """hyla state-dict key -> (fla key, stored per GLA KV head, hyla shape), for every
    parameter hyla's model has under ``cfg``."""
    kinds = _blocks(cfg)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in HylaLM(cfg).state_dict().items()}
    names = {}
    for ours, shape in shapes.items():
        if ours in _TOP:
            if not (cfg.tie_embeddings and ours == "lm_head.weight"):
                names[ours] = (_TOP[ours], False, shape)
            continue
        _, i, rest = ours.split(".", 2)
        where, _, suffix = rest.partition(".")
        if where == "mixer":
            fmt = _FORMATS[kinds[int(i)]]
            theirs = fmt.renames.get(suffix, suffix)
            theirs = theirs if layout.fuse_norm else _UNFUSED.get(theirs, theirs)
            names[ours] = (f"model.layers.{i}.attn.{theirs}", suffix in fmt.grouped, shape)
        else:       # mixer_norm -> attn_norm; mlp_norm and mlp.* keep their names
            theirs = "attn_norm" if where == "mixer_norm" else where
            names[ours] = (f"model.layers.{i}.{theirs}.{suffix}", False, shape)
    return names


def _blocks(cfg: HylaConfig) -> list[type]:
    """The mixer class of each layer (ValueError for a kind fla's GLA format cannot hold)."""
    kinds = [MIXERS[letter] for letter in cfg.layers]
    bad = sorted({k.letter for k in kinds if k not in _FORMATS})
    if bad:
        raise ValueError(f"layers={cfg.layers!r} has layer kind(s) {bad}: fla's GLA format "
                         f"holds only {[k.letter for k in _FORMATS]} layers")
    return kinds


def fla_state_to_hyla(weights: dict[str, torch.Tensor], cfg: HylaConfig, layout: _FlaLayout,
                      source: str = "model.safetensors") -> dict[str, torch.Tensor]:
    """Rename (and, for GLA KV heads, expand) an fla state dict to hyla's, checking every
    shape against ``cfg`` and refusing tensors hyla would not use."""
    weights, out = dict(weights), {}
    groups = cfg.n_heads // layout.gla_kv_heads
    for ours, (theirs, grouped, want) in _fla_names(cfg, layout).items():
        if theirs not in weights and ours.endswith("g_norm.weight") and not layout.norm_weights:
            out[ours] = torch.ones(want)           # elementwise_affine: false
            continue
        if theirs not in weights:
            raise ValueError(f"{source} has no tensor {theirs!r}: expected fla's "
                             f"GLAForCausalLM state dict for this config")
        t = weights.pop(theirs)
        stored = (want[0] // groups, *want[1:]) if grouped else want
        if tuple(t.shape) != stored:
            raise ValueError(f"{source}: {theirs} has shape {tuple(t.shape)}, config.json "
                             f"implies {stored}")
        if grouped and groups > 1:
            t = expand_kv_heads(t.reshape(t.shape[0], -1), layout.gla_kv_heads,
                                cfg.n_heads).reshape(want)
        out[ours] = t
    if cfg.tie_embeddings:
        head = weights.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, out["embed.weight"]):
            raise ValueError(f"{source}: lm_head.weight differs from model.embeddings.weight "
                             f"although tie_word_embeddings is true")
    if weights:
        raise ValueError(f"{source} has tensors hyla does not map: {sorted(weights)[:4]}"
                         f"{' ...' if len(weights) > 4 else ''}")
    return out


def load_fla(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu"):
    """Load an fla GLA directory as (HylaLM in eval mode, tokenizer).

    Example:
        >>> import tempfile
        >>> from hyla.data import ByteTokenizer
        >>> from hyla.model import preset
        >>> d = export_fla(HylaLM(preset("debug")), ByteTokenizer(), tempfile.mkdtemp())
        >>> model, tok = load_fla(d)
        >>> model.cfg.layers, type(tok).__name__
        ('GGGA', 'ByteTokenizer')
    """
    root = pathlib.Path(path)
    source = root / "config.json"
    if not source.is_file():
        raise ValueError(f"{root} has no config.json: expected an fla GLA model directory")
    try:
        fla = json.loads(source.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from e
    if not isinstance(fla, dict):
        raise ValueError(f"{source} must hold a JSON object, got {type(fla).__name__}")
    cfg, layout = fla_config_to_hyla(fla, str(source))
    state = fla_state_to_hyla(read_safetensors(root, dtype), cfg, layout,
                              str(root / "model.safetensors"))
    with torch.device("meta"):
        model = HylaLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.load_state_dict(state, strict=not cfg.tie_embeddings)
    return model.eval(), load_hf_tokenizer(root, cfg.vocab_size, required=False)


def hyla_to_fla_config(cfg: HylaConfig) -> dict:
    """The fla ``GLAConfig`` dict of a hyla config with ``G`` and ``A`` layers.

    Example:
        >>> from hyla.model import preset
        >>> fla = hyla_to_fla_config(preset("debug"))
        >>> fla["model_type"], fla["attn"]["layers"], fla["attn"]["num_kv_heads"]
        ('gla', [3], 2)
    """
    defaults = {f.name: f.default for f in dataclasses.fields(HylaConfig)
                if f.default is not dataclasses.MISSING}
    for name, value in cfg.to_dict().items():
        if name not in _EXPORTED | {"attention_head_dim"} and value != defaults.get(name, value):
            raise ValueError(f"{name}={value!r} has no flash-linear-attention GLA equivalent: "
                             f"expected {defaults[name]!r} to export with --format fla")
    if cfg.attention_head_dim not in (None, cfg.d_model // cfg.n_heads):
        raise ValueError(f"attention_head_dim={cfg.attention_head_dim} cannot be exported to "
                         f"fla: its attention layers use hidden_size / num_heads = "
                         f"{cfg.d_model // cfg.n_heads}")
    for name in ("gate_logit_normalizer", "gate_low_rank_dim"):
        if getattr(cfg, name) != FIXED_GATE:
            raise ValueError(f"{name}={getattr(cfg, name)} cannot be exported to fla: fla's "
                             f"GLABlock always builds its GLA layer with {FIXED_GATE}")
    attn = [i for i, k in enumerate(_blocks(cfg)) if k is AttentionMixer]
    return {
        "architectures": ["GLAForCausalLM"], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_heads": cfg.n_heads, "num_kv_heads": None,
        "expand_k": cfg.expand_k, "expand_v": cfg.expand_v, "hidden_ratio": 4,
        "intermediate_size": cfg.ffn_dim, "hidden_act": "swish", "feature_map": None,
        "attn_mode": "chunk", "use_short_conv": False, "conv_size": 4,
        "use_output_gate": True, "clamp_min": None, "use_gk": True, "use_gv": False,
        "elementwise_affine": True, "norm_eps": cfg.norm_eps,
        "attn": {"layers": attn, "num_heads": cfg.n_heads, "num_kv_heads": cfg.n_kv_heads,
                 "qkv_bias": cfg.attention_bias, "window_size": cfg.sliding_window,
                 "rope_theta": cfg.rope_theta} if attn else None,
        "max_position_embeddings": 2048,     # fla: only the initial size of its rotary cache
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.initializer_range,
        "fuse_norm": True, "fuse_swiglu": True, "fuse_cross_entropy": True,
        "fuse_linear_cross_entropy": False, "use_l2warp": False, "attnres_block_size": None,
        "use_cache": True, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "torch_dtype": "float32", "dtype": "float32",
    }


def export_fla(model: HylaLM, tokenizer, out_dir: str | os.PathLike) -> pathlib.Path:
    """Write a hyla model with ``G`` and ``A`` layers as an fla ``GLAForCausalLM`` directory
    (fp32 safetensors, ``config.json``, ``tokenizer.json`` + ``tokenizer_config.json``).

    Example:
        >>> import tempfile
        >>> from hyla.data import ByteTokenizer
        >>> from hyla.model import preset
        >>> d = export_fla(HylaLM(preset("debug")), ByteTokenizer(), tempfile.mkdtemp())
        >>> json.loads((d / "config.json").read_text())["attn"]["layers"]
        [3]
    """
    cfg = model.cfg
    if cfg.family is not None:
        raise ValueError(f"this model is a {cfg.family!r} model: export it with --format "
                         f"transformers (its own format); fla's GLA format holds GLA hybrids")
    config = hyla_to_fla_config(cfg)
    layout = _FlaLayout(gla_kv_heads=cfg.n_heads, fuse_norm=True, norm_weights=True)
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    state = {theirs: sd[ours] for ours, (theirs, _, _) in _fla_names(cfg, layout).items()}
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config |= save_hf_tokenizer(tokenizer, out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out

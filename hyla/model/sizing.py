"""A model's sizes from its config alone: no weights are read, nothing is allocated.

- :func:`read_config`: the :class:`~hyla.model.HylaConfig` of a model directory or of a
  ``config.json`` (a transformers family, Llama / Mistral / Qwen2 / Qwen3, an fla GLA config,
  or hyla's own), with the same refusals as loading it;
- :func:`parameter_counts`: parameters (a model built on the meta device) and the *active*
  parameters a token runs through: a mixture-of-experts layer counts its router, ``top_k``
  routed experts and its shared expert (each FFN kind's ``active_parameters``);
- :func:`layer_windows`: which layers keep only their last ``w`` tokens (sliding windows);
- :func:`prefill_flops`: the FLOPs of prefilling ``T`` tokens, ``2 * N * T`` for the
  matmuls of the ``N`` active block parameters, plus each attention layer's (query, key)
  pairs (its window's, for a sliding-window layer) and each linear layer's state work.

Example:
    >>> cfg = HylaConfig(vocab_size=256, d_model=64, layers="GA", n_heads=4, ffn_dim=128,
    ...                  ffn_layers="SE", ffn_options={"moe": {"num_experts": 8, "top_k": 2,
    ...                  "expert_dim": 32}})
    >>> c = parameter_counts(cfg)
    >>> c["total"] - c["active"] == 6 * 3 * 64 * 32       # 6 of the 8 experts idle a token
    True
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib

import torch

from hyla.model.config import HylaConfig
from hyla.model.ffn import FFNS
from hyla.model.mixers import MIXERS, layer_specs


def read_config(source: str | os.PathLike) -> HylaConfig:
    """The config of a model directory (or a training run's, a ``config.json`` path, a GGUF
    file's metadata, or a model name ``hyla models`` lists): nothing but the config is read.

    A ``model_type`` picks the reader: a registered transformers family
    (:data:`hyla.model.formats.families.FAMILIES`), Llama / Mistral / Qwen2 / Qwen3, or fla's
    ``gla``; without one the file is a hyla config. Anything else is a ValueError naming the
    file and what is wrong with it.

    Example:
        >>> import json, tempfile
        >>> path = tempfile.mkdtemp() + "/config.json"
        >>> _ = open(path, "w").write(json.dumps({"model_type": "qwen3", "vocab_size": 300,
        ...     "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        ...     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}))
        >>> read_config(path).layers
        'AA'
    """
    path = pathlib.Path(os.fspath(source))
    if not path.exists():
        from hyla.model.names import resolve_name

        path = resolve_name(os.fspath(source)) or path     # a model name (hyla models)
    if not path.exists():
        raise ValueError(f"{str(path)!r}: no such file or directory: expected a model "
                         f"directory or its config.json")
    if path.is_dir():
        from hyla.model.formats.checkpoint import CONFIG, latest_checkpoint

        path = path / CONFIG if (path / CONFIG).is_file() else latest_checkpoint(path) / CONFIG
        if not path.is_file():
            raise ValueError(f"{str(source)!r} has no config.json: expected a model directory "
                             f"(hyla, transformers or fla) or a config.json path")
    if path.suffix == ".gguf":
        from hyla.model.formats.gguf.load import gguf_config

        # its metadata only: the tensors' shapes, never their data
        return config_from_dict(gguf_config(path), f"{path} (GGUF metadata)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return config_from_dict(data, str(path))


def config_from_dict(data: dict, source: str = "config.json") -> HylaConfig:
    """:func:`read_config` for a config already read: ``data`` from ``source``."""
    if "model_type" in data:
        from hyla.model.formats.families import FAMILIES
        from hyla.model.formats.hf import ARCHITECTURES, hf_config_to_hyla

        kind = data["model_type"]
        if isinstance(kind, str) and kind in FAMILIES:
            return FAMILIES[kind].to_config(data, source)
        if kind in ARCHITECTURES:
            return hf_config_to_hyla(data, source)
        from hyla.model.formats import fla

        if kind == fla.MODEL_TYPE:
            return fla.fla_config_to_hyla(data, source)[0]
        known = sorted({*FAMILIES, *ARCHITECTURES, fla.MODEL_TYPE})
        raise ValueError(f"{source}: model_type {kind!r} is not supported: expected one of "
                         f"{known}")
    missing = [k for k in ("vocab_size", "d_model", "layers", "n_heads", "ffn_dim")
               if k not in data]
    if missing:
        raise ValueError(f"{source} is neither a transformers config (it has no 'model_type') "
                         f"nor a hyla config (it has no {missing})")
    try:
        return HylaConfig(**data)
    except TypeError as e:
        raise ValueError(f"{source} is not a valid hyla config: {e}") from e


_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
          "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def skip_init():
    """Make ``torch.nn.init`` initialisers no-ops (meta tensors have no values anyway).

    Why: on the meta device torch's ``normal_`` goes through a reference implementation that
    imports ``torch._dynamo``, about 3 s the first time in a process, for nothing.
    """
    saved = {name: getattr(torch.nn.init, name) for name in _INITS
             if hasattr(torch.nn.init, name)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def meta_model(cfg: HylaConfig):
    """``HylaLM(cfg)`` on the meta device: shapes only, no memory (a 1T config in seconds)."""
    from hyla.model.model import HylaLM  # model.py imports this package's neighbours

    with torch.device("meta"), skip_init():
        return HylaLM(cfg)


def parameter_counts(cfg: HylaConfig) -> dict:
    """Parameter counts of ``HylaLM(cfg)``.

    Keys: ``total`` (tied embeddings counted once), ``active`` (what one token runs through:
    ``total`` less, in every layer, its FFN's parameters a token does not use), ``embedding``
    (the input table), ``lm_head`` (0 when tied), ``matmul_active`` (``active`` less the
    input table, a lookup, and the output head, which prefill runs for its last token only:
    the ``N`` of ``2 * N`` FLOPs a token), ``moe_layers``.
    """
    model = meta_model(cfg)
    total = model.num_parameters()
    idle = 0
    for i in range(cfg.n_layers):
        ffn, layer = FFNS[cfg.ffn_letter(i)], cfg.layer_config(i)
        idle += ffn.parameters_count(layer) - ffn.active_parameters(layer)
    embedding = cfg.vocab_size * cfg.d_model
    head = 0 if cfg.tie_embeddings else embedding
    active = total - idle
    return {"total": total, "active": active, "embedding": embedding, "lm_head": head,
            "matmul_active": active - embedding - head,
            "moe_layers": sum(cfg.ffn_letter(i) == "E" for i in range(cfg.n_layers))}


def layer_windows(cfg: HylaConfig) -> list[int | None]:
    """Per layer: its sliding window when the layer attends to its last ``sliding_window``
    tokens only (keeping them in a ring: :attr:`StateSpec.window`); None otherwise.

    Example:
        >>> cfg = HylaConfig(vocab_size=256, d_model=64, layers="GAA", n_heads=4, ffn_dim=128,
        ...                  layer_overrides=[{}, {"sliding_window": 8}, {}])
        >>> layer_windows(cfg)
        [None, 8, None]
    """
    return [spec.window for spec in layer_specs(cfg)]


def bounded_state_bytes(cfg: HylaConfig, context: int,
                        kv_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a sequence holds after ``context`` tokens: a sliding-window layer's ring
    counts the rows it has filled (``min(context, window)``, as transformers' caches hold),
    every other layer its StateSpec's bytes (:func:`hyla.eval.memory.state_bytes`)."""
    total = 0
    for spec in layer_specs(cfg):
        fixed = spec.fixed_bytes(kv_dtype)
        if spec.window is not None:
            fixed = fixed * min(context, spec.window) // spec.window
        total += fixed + context * spec.per_token_bytes(kv_dtype)
    return total


def causal_pairs(tokens: int, window: int | None = None) -> int:
    """(query, key) pairs of causal attention over ``tokens`` tokens, each query seeing at
    most ``window`` keys (itself included).

    Example:
        >>> causal_pairs(4), causal_pairs(4, window=2)
        (10, 7)
    """
    if window is None or window >= tokens:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def prefill_flops(cfg: HylaConfig, tokens: int, counts: dict | None = None) -> dict:
    """FLOPs of prefilling one ``tokens``-token prompt: ``{"matmul", "attention", "linear",
    "total"}``. ``matmul`` is ``2 * matmul_active * tokens`` (:func:`parameter_counts`),
    ``attention`` each attention layer's ``pair_flops`` times its causal (query, key) pairs,
    ``linear`` each linear layer's ``token_flops`` (its state update and readout) a token."""
    counts = counts or parameter_counts(cfg)
    attn = linear = 0.0
    for i, (letter, w) in enumerate(zip(cfg.layers, layer_windows(cfg), strict=True)):
        mixer, layer = MIXERS[letter], cfg.layer_config(i)
        attn += mixer.pair_flops(layer) * causal_pairs(tokens, w)
        linear += mixer.token_flops(layer) * tokens
    matmul = 2.0 * counts["matmul_active"] * tokens
    return {"matmul": matmul, "attention": attn, "linear": linear,
            "total": matmul + attn + linear}

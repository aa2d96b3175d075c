"""The type and range of every :class:`~hyla.model.config.HylaConfig` field, checked before
anything else (a ``config.json`` that lies fails fast, naming the field, never with a
traceback from deep inside a layer or a hang building a million layers).

Example:
    >>> check_fields({"norm_eps": "x"}, {"norm_eps": "float"})
    Traceback (most recent call last):
    ...
    ValueError: norm_eps must be a finite number, got 'x'
"""

from __future__ import annotations

import math

# The most layers a model may have: every published LM has far fewer (under 200), and a
# config past it is a mistake or an attack (building 10^6 layers hangs for minutes).
MAX_LAYERS = 1024

# Numbers that must be > 0 (the others only finite, or >= 0 as listed).
POSITIVE = {"vocab_size", "d_model", "n_heads", "ffn_dim", "gate_low_rank_dim", "n_kv_heads",
            "attention_head_dim", "sliding_window", "chunk_size", "expand_k", "expand_v",
            "gate_logit_normalizer", "norm_eps", "rope_theta", "embedding_scale",
            "residual_scale", "logit_scale"}
NON_NEGATIVE = {"initializer_range", "linear_window", "window_sinks"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


_CHECKS = {    # annotation -> (test, what it expects)
    "int": (_is_int, "an int"),
    "float": (_is_number, "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "a dict"),
    "list": (lambda v: isinstance(v, list | tuple), "a list"),
}


def check_fields(values: dict, annotations: dict) -> None:
    """ValueError naming the first field of ``values`` whose value does not have the type of
    its annotation (``"int"``, ``"float | None"``, ...) or is out of range (non-finite,
    <= 0 for the :data:`POSITIVE` fields, < 0 for :data:`NON_NEGATIVE`); ``layers`` longer
    than :data:`MAX_LAYERS` too."""
    for name, annotation in annotations.items():
        value = values[name]
        kinds = [k.strip() for k in str(annotation).split("|")]
        if value is None and "None" in kinds:
            continue
        tests = [_CHECKS[k] for k in kinds if k in _CHECKS]
        if tests and not any(test(value) for test, _ in tests):
            expected = " or ".join([what for _, what in tests]
                                   + (["null"] if "None" in kinds else []))
            raise ValueError(f"{name} must be {expected}, got {_short(value)}")
        if name in POSITIVE and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
        if name in NON_NEGATIVE and not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    layers = values.get("layers")
    if isinstance(layers, str) and len(layers) > MAX_LAYERS:
        raise ValueError(f"layers has {len(layers)} letters: a model has at most "
                         f"{MAX_LAYERS} layers (hyla.model.config.MAX_LAYERS)")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({type(value).__name__} of " \
                                         f"{len(value) if hasattr(value, '__len__') else '?'})"

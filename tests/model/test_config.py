"""HylaConfig validation and presets."""

import dataclasses

import pytest

from hyla.model import PRESETS, HylaConfig, preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_valid(name):
    cfg = preset(name)
    assert isinstance(cfg, HylaConfig)
    assert cfg.head_k_dim * cfg.n_heads == cfg.key_dim
    assert cfg.n_heads % cfg.n_kv_heads == 0
    assert preset(name) is not cfg          # a fresh config each call


def test_debug_layout():
    cfg = preset("debug")
    assert (cfg.layers, cfg.n_layers, cfg.head_k_dim, cfg.head_v_dim, cfg.kv_dim) == \
        ("GGGA", 4, 8, 16, 32)


@pytest.mark.parametrize("kwargs,match", [
    ({"layers": "GGX"}, "unknown letter"),
    ({"layers": ""}, "layers must be"),
    ({"n_heads": 6, "n_kv_heads": 6}, "divisible by n_heads"),
    ({"n_kv_heads": 3}, "n_kv_heads must divide"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"chunk_size": 48}, "chunk_size"),
    ({"gate_logit_normalizer": 0.0}, "gate_logit_normalizer"),
    ({"mtp_options": {"layer": 3}}, "mtp_options must be"),
    ({"mtp_options": {"like": -1}}, r"mtp_options\['like'\]"),
    ({"mtp_options": {"like": 9}}, r"mtp_options\['like'\]"),
    ({"mtp_options": {"ffn": "Q"}}, r"mtp_options\['ffn'\]"),
    ({"mtp_options": {"per_layer_fusion": "yes"}}, "per_layer_fusion"),
], ids=["letter", "empty", "heads", "kv-heads", "vocab", "chunk", "normalizer", "mtp-key",
        "mtp-like-negative", "mtp-like-range", "mtp-ffn", "mtp-fusion"])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(preset("debug"), **kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")

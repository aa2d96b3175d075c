"""Every HylaConfig field is checked by type and range before anything is built (issue 32,
item 4): a config.json that lies fails fast with the field named, never a traceback or a
hang."""

import dataclasses
import json
import time

import pytest

from hyla.model import HylaConfig, HylaLM, preset
from hyla.model.config import MAX_LAYERS
from hyla.model.formats.checkpoint import CONFIG, save_checkpoint
from hyla.model.load import load_model


def test_a_million_layers_fails_fast_naming_the_bound():
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"layers .*1000000 .*at most {MAX_LAYERS}"):
        dataclasses.replace(preset("debug"), layers="G" * 10**6)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("field,value", [
    ("norm_eps", "x"), ("norm_eps", float("nan")), ("norm_eps", 0.0), ("norm_eps", -1e-6),
    ("rope_theta", float("nan")), ("rope_theta", float("inf")), ("rope_theta", 0),
    ("rope_theta", "10000"), ("expand_k", "0.5"), ("expand_v", float("nan")),
    ("gate_logit_normalizer", float("nan")), ("initializer_range", -0.1),
    ("initializer_range", float("inf")), ("tie_embeddings", "yes"), ("tie_embeddings", 1),
    ("chunk_size", "64"), ("n_kv_heads", "2"), ("n_kv_heads", 2.0), ("d_model", 64.0),
    ("vocab_size", True), ("attention_bias", "false"), ("qk_norm", None),
    ("norm_zero_centred", 0), ("norm_placement", 1), ("family", 3), ("hf_extras", []),
    ("mixer_options", "x"), ("layer_overrides", "x"), ("ffn_layers", 4),
    ("sliding_window", 1.5), ("linear_window", "8"), ("rope_scaling", "linear"),
])
def test_every_field_is_checked_by_type_and_range(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(preset("debug"), **{field: value})


def test_ints_are_accepted_for_float_fields():
    cfg = dataclasses.replace(preset("debug"), rope_theta=500000, norm_eps=1, expand_v=1)
    assert cfg.rope_theta == 500000


def test_a_lying_config_json_is_a_clear_error(tmp_path):
    save_checkpoint(HylaLM(preset("debug")), tmp_path)
    cfg = json.loads((tmp_path / CONFIG).read_text())
    for field, value in (("norm_eps", "x"), ("layers", "G" * 10**6), ("rope_theta", "NaN")):
        (tmp_path / CONFIG).write_text(json.dumps(cfg | {field: value}).replace('"NaN"', "NaN"))
        with pytest.raises(ValueError, match=field):
            load_model(tmp_path)


def test_layer_overrides_are_checked_too():
    with pytest.raises(ValueError, match="rope_theta"):
        HylaConfig(vocab_size=256, d_model=64, layers="AA", n_heads=4, ffn_dim=128,
                   layer_overrides=[{}, {"rope_theta": float("nan")}])

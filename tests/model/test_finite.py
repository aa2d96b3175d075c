"""Weights are checked to be finite at load, each bad tensor named (issue 32, item 3)."""

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.model.finite import allowing_nonfinite, check_finite, nonfinite_tensors
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.model.load import load_model


def test_counts_nan_and_inf_per_tensor():
    t = {"a": torch.zeros(4), "b": torch.tensor([1.0, float("nan"), float("inf")]),
         "c": torch.tensor([-float("inf"), float("inf")]), "ids": torch.arange(3)}
    assert nonfinite_tensors(t) == [("b", 1, 1), ("c", 0, 2)]


def test_a_sum_that_overflows_is_not_a_false_alarm():
    assert nonfinite_tensors({"h": torch.full((64,), 6e4, dtype=torch.float16)}) == []


def test_refused_by_default_allowed_on_request(tmp_path, capsys):
    model = HylaLM(preset("debug"))
    with torch.no_grad():
        model.embed.weight[0, 0] = float("inf")
    save_checkpoint(model, tmp_path)
    with pytest.raises(ValueError, match=r"embed\.weight \(0 NaN, 1 inf\)"):
        load_model(tmp_path)
    with allowing_nonfinite():                 # what --allow-nonfinite sets
        load_model(tmp_path)
    assert "embed.weight" in capsys.readouterr().err
    with pytest.raises(ValueError, match="non-finite"):
        check_finite(model)

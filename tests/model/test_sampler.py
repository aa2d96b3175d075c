"""The sampler's draw and its nucleus (top-p) filter: the same distribution and the same
nucleus as the slow, obvious forms (``torch.multinomial``; a full sort)."""

import pytest
import torch

from hyla.model.sampler import NUCLEUS_CANDIDATES, draw, filter_logits, sample_token


def _sorted_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """What top-p keeps, by sorting the whole vocabulary."""
    s, order = torch.sort(logits, descending=True)
    probs = torch.softmax(s, -1)
    return order[~(probs.cumsum(-1) - probs >= top_p)].sort().values


@pytest.mark.parametrize("scale, top_p", [(1.0, 0.9), (4.0, 0.5), (0.05, 0.95), (0.01, 0.999)])
def test_the_nucleus_equals_the_sorted_one(scale, top_p):
    """Peaked rows (the nucleus among the candidates) and flat ones (it is not: the sort)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(8 * NUCLEUS_CANDIDATES, generator=g, dtype=torch.float64) * scale
        kept = torch.isfinite(filter_logits(logits, 0, top_p)).nonzero().flatten()
        assert torch.equal(kept, _sorted_nucleus(logits, top_p))


def test_the_nucleus_of_masked_and_tiny_rows():
    logits = torch.tensor([2.0, float("-inf"), 1.0, float("-inf")], dtype=torch.float64)
    assert torch.isfinite(filter_logits(logits, 0, 0.5)).tolist() == [True, False, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.99)).tolist() == [True, False, True, False]


def test_draws_follow_the_distribution_and_never_take_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(20_000)]),
                            minlength=6).double() / 20_000
    assert counts[[0, 2, 5]].sum() == 0
    assert (counts - probs).abs().max() < 0.015           # ~4 standard errors
    assert draw(torch.tensor([0.0, 3.0, 0.0])) == 1       # unnormalised


def test_a_seed_repeats_its_draws():
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    runs = [[sample_token(logits, 0.8, 0, 0.9, torch.Generator().manual_seed(7))
             for _ in range(3)] for _ in range(2)]
    assert runs[0] == runs[1]

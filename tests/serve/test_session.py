"""RunnerState: ``hyla generate``/``chat`` on the serving runner give what
HylaLM.prefill/decode gave, keep a conversation across calls and outgrow their first KV
reservation without losing it."""

from __future__ import annotations

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.model.stream import StreamTiming, stream_tokens
from hyla.serve.session import RunnerState


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return HylaLM(preset("debug")).eval()        # GGGA: GLA states and an attention layer


def _logits_both(model, state, prompt, tokens):
    first = [state.prefill(prompt) if isinstance(state, RunnerState)
             else model.prefill(torch.tensor(prompt), state)[-1]]
    for t in tokens:
        first.append(state.decode(t) if isinstance(state, RunnerState)
                     else model.decode(torch.tensor([t]), [state])[0])
    return torch.stack(first)


def test_runner_state_matches_the_model_path_and_grows(model):
    prompt, tokens = list(range(1, 30)), list(range(40, 80))
    ref = _logits_both(model, model.new_state(), prompt, tokens)
    small = RunnerState(model, capacity=16, block_size=4, chunk=8)   # grows 3 times
    got = _logits_both(model, small, prompt, tokens)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert small.num_tokens == len(prompt) + len(tokens) and small.num_blocks == 32


def test_stream_tokens_on_a_runner_state_continues_a_conversation(model):
    gen = torch.Generator().manual_seed(0)
    state, timing = RunnerState(model), StreamTiming()
    first = list(stream_tokens(model, state, [1, 2, 3], 5, temperature=0, timing=timing))
    more = list(stream_tokens(model, state, [first[-1], 9], 4, temperature=0.8,
                              generator=gen))
    ref_state = model.new_state()
    ref_first = list(stream_tokens(model, ref_state, [1, 2, 3], 5, temperature=0))
    ref_more = list(stream_tokens(model, ref_state, [ref_first[-1], 9], 4, temperature=0.8,
                                  generator=torch.Generator().manual_seed(0)))
    assert (first, more) == (ref_first, ref_more)
    assert state.num_tokens == ref_state.num_tokens == 3 + 4 + 2 + 3
    assert timing.prompt_tokens == 3 and timing.new_tokens == 5
    with pytest.raises(ValueError, match="at least one token"):
        state.prefill([])

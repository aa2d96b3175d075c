"""HylaLM: forward == prefill + decode, chunked prefill, batched decode, packed documents."""

import dataclasses

import pytest
import torch

from hyla.model import HylaLM, SequenceState, generate, preset

PATTERNS = ["GG", "AA", "GGGA"]


def make_model(layers="GGGA", **kw):
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("debug"), layers=layers, **kw)
    model = HylaLM(cfg).eval()
    # Larger-than-default weights so every layer visibly changes the logits.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return model


def ids(T, seed=1):
    return torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layers", PATTERNS)
def test_forward_equals_prefill_then_decode(layers):
    model = make_model(layers)
    x = ids(37)
    with torch.no_grad():
        full = model(x[None])[0]
    state = model.new_state()
    logits = [model.prefill(x[:20], state)]
    for t in range(20, 37):
        logits.append(model.decode(x[t:t + 1], [state]))
    assert state.num_tokens == 37
    assert (torch.cat(logits) - full).abs().max() < 1e-4


@pytest.mark.parametrize("layers", PATTERNS)
def test_prefill_in_pieces(layers):
    model = make_model(layers)
    x = ids(37)
    one = model.new_state()
    whole = model.prefill(x, one)
    two = model.new_state()
    parts = torch.cat([model.prefill(x[:13], two), model.prefill(x[None, 13:], two)])
    assert (parts - whole).abs().max() < 1e-4
    for a, b in zip(one.tensors, two.tensors, strict=True):
        for ta, tb in zip(a, b, strict=True):
            assert (ta - tb).abs().max() < 1e-4


@pytest.mark.parametrize("layers", PATTERNS)
def test_batched_decode_matches_single(layers):
    model = make_model(layers)
    prompts = [ids(n, seed=n) for n in (3, 11, 1)]
    batch = [model.new_state() for _ in prompts]
    single = [model.new_state() for _ in prompts]
    for p, sb, ss in zip(prompts, batch, single, strict=True):
        model.prefill(p, sb)
        model.prefill(p, ss)
    for step in range(4):
        tokens = torch.tensor([7 * step + b for b in range(len(prompts))])
        together = model.decode(tokens, batch)
        alone = torch.cat([model.decode(tokens[b:b + 1], [single[b]])
                           for b in range(len(prompts))])
        assert (together - alone).abs().max() < 1e-4
    assert [s.num_tokens for s in batch] == [7, 15, 5]


@pytest.mark.parametrize("layers", PATTERNS)
def test_forward_packed_documents(layers):
    model = make_model(layers)
    a, b = ids(14, seed=2), ids(23, seed=3)
    with torch.no_grad():
        packed = model(torch.cat([a, b])[None], cu_seqlens=torch.tensor([0, 14, 37]))[0]
        sep = torch.cat([model(a[None])[0], model(b[None])[0]])
    assert (packed - sep).abs().max() < 1e-4


def test_forward_batch_and_grad():
    model = make_model()
    x = torch.stack([ids(37, seed=s) for s in range(2)])
    logits = model(x)
    assert logits.shape == (2, 37, 256)
    logits.logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing


def test_tied_embeddings_and_init():
    model = HylaLM(dataclasses.replace(preset("debug"), tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    untied = HylaLM(preset("debug"))
    cfg = preset("debug")
    assert untied.num_parameters() - model.num_parameters() == cfg.vocab_size * cfg.d_model
    gate_bias = model.blocks[0].mixer.gk_proj[1].bias
    assert torch.count_nonzero(gate_bias) == 0
    assert torch.all(model.norm.weight == 1)


def test_laplace_3b_param_count_on_meta():
    with torch.device("meta"):
        model = HylaLM(preset("laplace-3b"))
    n = model.num_parameters()
    print(f"laplace-3b parameters: {n:,}")
    assert abs(n - 3.03e9) / 3.03e9 < 0.01
    assert SequenceState.empty(preset("laplace-3b"), device="meta").nbytes == 24 * 16 * 96 * 192 * 4


def test_small_param_count():
    with torch.device("meta"):
        n = HylaLM(preset("small")).num_parameters()
    print(f"small parameters: {n:,}")
    assert 10e6 < n < 30e6


def test_bad_input():
    model = make_model()
    with pytest.raises(ValueError, match="input_ids"):
        model(ids(5))
    with pytest.raises(ValueError, match="B == 1"):
        model(torch.zeros(2, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="input_ids"):
        model.prefill(torch.zeros(2, 3, dtype=torch.long), model.new_state())
    with pytest.raises(ValueError, match="state"):
        model.prefill(ids(3), SequenceState.empty(preset("small")))
    st = model.new_state()
    with pytest.raises(ValueError, match="distinct"):
        model.decode(torch.tensor([1, 2]), [st, st])
    with pytest.raises(ValueError, match="one SequenceState per token"):
        model.decode(torch.tensor([1, 2]), [st])


def test_generate_greedy_matches_forward():
    model = make_model()
    prompt = ids(9).tolist()
    out = generate(model, prompt, 6, temperature=0)
    assert len(out) == 6
    with torch.no_grad():
        logits = model(torch.tensor(prompt + out)[None])[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out


def test_generate_sampling_seed_and_stop():
    model = make_model()
    a = generate(model, [1, 2, 3], 8, temperature=1.0, top_k=5, seed=123)
    b = generate(model, [1, 2, 3], 8, temperature=1.0, top_k=5, seed=123)
    assert a == b and len(a) == 8
    stopped = generate(model, [1, 2, 3], 8, temperature=1.0, top_k=5, seed=123,
                       stop_ids=(a[2],))
    assert stopped == a[:a.index(a[2])]
    assert generate(model, [1], 0) == []
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(model, [], 3)

"""The engine against HylaLM's own greedy loop, under chunking, caching and preemption."""

import dataclasses

import pytest
import torch

from hyla.data.tokenizer import ByteTokenizer
from hyla.model import HylaLM, preset
from hyla.model.generate import generate
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.prefix_cache import block_hashes
from hyla.serve.sequence import SamplingParams


def _model(layers="GGGA", seed=0):
    torch.manual_seed(seed)
    return HylaLM(dataclasses.replace(preset("debug"), layers=layers)).eval()


def _prompts(n, seed=1, lo=1, hi=90):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (t,), generator=g).tolist() for t in lens]


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("layers", ["GGGA", "GGGG", "AA"])
@pytest.mark.parametrize("cfg", [
    dict(),                                                    # one prefill per prompt
    dict(max_num_batched_tokens=24, snapshot_interval=16),     # chunked, mixed steps
    dict(max_num_seqs=3),                                      # queueing
    dict(num_kv_blocks=12, max_num_batched_tokens=64),         # preemption (attention)
], ids=["plain", "chunked", "queued", "preempt"])
def test_greedy_matches_model_loop(layers, cfg):
    model = _model(layers)
    prompts = _prompts(7)
    want = [generate(model, p, 12, temperature=0) for p in prompts]
    if "A" not in layers:
        cfg = {k: v for k, v in cfg.items() if k != "num_kv_blocks"}
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, **cfg))
    seqs = eng.generate(prompts, GREEDY)
    assert [s.output_ids for s in seqs] == want
    assert eng.scheduler.pool.num_used == 0
    if eng.scheduler.blocks is not None:
        assert all(r == 0 for r in eng.scheduler.blocks.ref_count)
    if cfg.get("num_kv_blocks"):
        assert eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("layers", ["GGGA", "GGGG", "AA"])
def test_prefix_cache_hit_gives_same_tokens(layers):
    model = _model(layers)
    shared = _prompts(1, seed=3, lo=70, hi=71)[0]
    tails = _prompts(3, seed=4, lo=3, hi=9)
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, snapshot_interval=32))
    eng.generate([shared + tails[0]], GREEDY)
    seqs = eng.generate([shared + t for t in tails[1:]], GREEDY)
    assert all(s.num_cached_tokens == 64 for s in seqs)        # two 32-token boundaries
    assert [s.output_ids for s in seqs] == [generate(model, shared + t, 12, temperature=0)
                                            for t in tails[1:]]
    assert eng.scheduler.prefix_cache.hit_rate > 0


def test_a_corrupted_snapshot_is_dropped_and_recomputed():
    """A snapshot whose bytes changed since it was saved (one flipped bit) is never
    restored: the prompt matches the boundary before it, and the answer is a fresh one's."""
    model = _model("GGGA")
    shared = _prompts(1, seed=3, lo=70, hi=71)[0]
    tails = _prompts(2, seed=4, lo=3, hi=9)
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, snapshot_interval=32))
    eng.generate([shared + tails[0]], GREEDY)
    pc, runner = eng.scheduler.prefix_cache, eng.runner
    at64 = pc.snapshots[block_hashes(shared, 16)[3]]
    assert runner.snapshot_intact(at64)
    state = runner.snapshots[0]["state"][at64]                  # the first GLA layer's
    state.view(torch.int32).view(-1)[5] ^= 1 << 3               # one bit
    assert not runner.snapshot_intact(at64)
    (seq,) = eng.generate([shared + tails[1]], GREEDY)
    assert seq.num_cached_tokens == 32 and pc.corrupt_snapshots == 1
    assert seq.output_ids == generate(model, shared + tails[1], 12, temperature=0)


def test_sampling_seed_and_stops():
    model = _model()
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128))
    p = SamplingParams(max_tokens=20, temperature=1.0, top_k=20, top_p=0.9, seed=7,
                       ignore_eos=True)
    a, b = eng.generate([[1, 2, 3], [1, 2, 3]], p)
    assert a.output_ids == b.output_ids                          # same seed, same tokens
    stop_tok = a.output_ids[5]
    c, = eng.generate([[1, 2, 3]], dataclasses.replace(p, stop_token_ids=(stop_tok,)))
    assert c.finish_reason == "stop" and c.output_ids[-1] == stop_tok
    assert len(c.output_ids) == a.output_ids.index(stop_tok) + 1


def test_stop_string_cuts_text():
    tok = ByteTokenizer()
    model = _model()
    eng = Engine(model, tok, EngineConfig(max_model_len=128))
    free = eng.generate([[65, 66]], GREEDY)[0]
    text = tok.decode(free.output_ids)
    stop = text[4:6]
    rid = eng.add_request([65, 66], dataclasses.replace(GREEDY, stop=(stop,))).request_id
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == text[:text.find(stop)]


def test_logprobs_are_log_softmax():
    model = _model()
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128))
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=1, temperature=0, logprobs=3,
                                              ignore_eos=True))
    out, = eng.step()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([[5, 6, 7]]))[0, -1].float(), -1)
    lp = out.logprobs[0]
    assert lp.token == int(want.argmax())
    assert abs(lp.logprob - float(want.max())) < 1e-4
    assert [t for t, _ in lp.top] == torch.topk(want, 3).indices.tolist()


def test_abort_frees_slot_and_blocks():
    eng = Engine(_model(), ByteTokenizer(), EngineConfig(max_model_len=128))
    seqs = [eng.add_request(p, GREEDY) for p in _prompts(4)]
    eng.step()
    for s in seqs:
        assert eng.abort(s.request_id)
    assert not eng.has_unfinished() and eng.scheduler.pool.num_used == 0
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


def test_bad_requests_are_rejected():
    eng = Engine(_model(), ByteTokenizer(), EngineConfig(max_model_len=64))
    with pytest.raises(ValueError, match="context length"):
        eng.add_request([1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="at least one token"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request([300], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_compiled_decode_one_graph_per_width_and_same_tokens():
    model = _model("GGGG")
    prompts = _prompts(5, seed=9, lo=2, hi=20)
    want = [generate(model, p, 6, temperature=0) for p in prompts]
    eng = Engine(model, None, EngineConfig(max_num_seqs=4, max_model_len=64, compile=True,
                                           decode_widths=(4,)))
    seqs = []
    for p in prompts:                   # staggered: batches of 1 .. 4 all pad to width 4
        seqs.append(eng.add_request(p, dataclasses.replace(GREEDY, max_tokens=6)))
        eng.step()
    while eng.has_unfinished():
        eng.step()
    assert [s.output_ids for s in seqs] == want
    assert eng.runner.num_compilations == 1


def test_add_prefilled_continues_like_local_prefill():
    model = _model()
    prompt = _prompts(1, seed=5, lo=20, hi=21)[0]
    want = generate(model, prompt, 8, temperature=0)
    state = model.new_state()
    first = int(model.prefill(torch.tensor(prompt), state)[-1].argmax())
    shipped = type(state).unflatten(state.flatten())
    eng = Engine(model, None, EngineConfig(max_model_len=64))
    seq = eng.add_prefilled(prompt, first, shipped, dataclasses.replace(GREEDY, max_tokens=8))
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == want
    with pytest.raises(ValueError, match="holds"):
        eng.add_prefilled(prompt[:-1], first, shipped, GREEDY)


def _undecodable(*args, **kwargs):
    """What a tokenizer does with a sampled id it cannot turn into text."""
    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


def test_one_request_failing_does_not_stop_the_others():
    import asyncio

    from hyla.serve.async_engine import AsyncEngine

    eng = Engine(_model(), ByteTokenizer(), EngineConfig(max_model_len=128))
    bad = eng.add_request([5, 6, 7], GREEDY, "bad")
    good = eng.add_request([8, 9, 10], GREEDY, "good")
    eng._text["bad"].add = _undecodable          # its first token's text fails
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    errs = [o for o in outs if o.error]
    assert [o.request_id for o in errs] == ["bad"] and "invalid start byte" in errs[0].error
    assert errs[0].finished and errs[0].finish_reason == "error"
    assert bad.is_finished and good.is_finished and len(good.output_ids) == 12
    assert eng.scheduler.pool.num_free == eng.config.max_num_seqs      # nothing leaked

    ae = AsyncEngine(Engine(_model(), ByteTokenizer(), EngineConfig(max_model_len=128)))
    real_add = ae.engine.add_request

    def add(prompt, params, rid=None, arrival=None):
        seq = real_add(prompt, params, rid, arrival)
        if rid == "bad":
            ae.engine._text[rid].add = _undecodable
        return seq
    ae.engine.add_request = add

    async def run(rid):
        return [o async for o in ae.generate([5, 6, 7], GREEDY, rid)]

    async def both():
        return await asyncio.gather(run("bad"), run("good"), return_exceptions=True)
    try:
        bad_res, good_res = asyncio.run(both())
        assert isinstance(bad_res, RuntimeError) and "request bad failed" in str(bad_res)
        assert sum(len(o.token_ids) for o in good_res) == 12 and good_res[-1].finished
        assert ae.error is None                        # the engine thread is still up
    finally:
        ae.shutdown()


def test_rejected_request_leaves_nothing_queued():
    eng = Engine(_model(), None, EngineConfig(max_model_len=64))     # token-only
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.add_request([1, 2, 3], dataclasses.replace(GREEDY, stop=("x",)), "r")
    assert not eng.has_unfinished() and eng.scheduler.num_waiting == 0
    assert eng.step() == []
    assert eng.add_request([1, 2, 3], GREEDY, "r").request_id == "r"    # the id is free


@pytest.mark.parametrize("layers", ["GGGA", "AA"])
def test_prefill_only_hands_over_a_state_that_decodes_like_local(layers):
    model = _model(layers)
    prompt = _prompts(1, seed=5, lo=40, hi=41)[0]
    want = generate(model, prompt, 8, temperature=0)
    params = dataclasses.replace(GREEDY, max_tokens=8)
    pre = Engine(model, None, EngineConfig(max_model_len=48, max_num_batched_tokens=16))
    # only the prompt must fit; stop strings are the decoder's business
    pre.add_request(prompt, dataclasses.replace(params, stop=("z",)), "p", prefill_only=True)
    outs = []
    while pre.has_unfinished():
        outs += pre.step()                       # 3 chunks; only the last one samples
    (o,) = outs
    assert o.finished and o.token_ids == want[:1] and o.state.num_tokens == len(prompt)
    assert pre.scheduler.pool.num_used == 0
    assert pre.scheduler.blocks.num_free == pre.scheduler.blocks.num_blocks
    dec = Engine(model, None, EngineConfig(max_model_len=64))
    seq = dec.add_prefilled(prompt, o.token_ids[0], type(o.state).unflatten(o.state.flatten()),
                            params)
    while dec.has_unfinished():
        dec.step()
    assert seq.output_ids == want


@pytest.mark.parametrize("layers", ["GGGA", "AA"])
def test_a_state_shipped_after_a_cached_prefix_decodes_like_local(layers):
    """PrfaaS: a decode engine whose prefix cache holds a conversation's first turn is sent
    the next turn's state without that prefix's attention rows (SequenceState.suffix): it
    loads them after its cached blocks and decodes as a local prefill would. Where the
    prefix was evicted (another engine), the prompt is computed there instead: the same
    tokens. Either way the loaded prompt joins the cache."""
    model = _model(layers)
    first_turn = _prompts(1, seed=5, lo=40, hi=41)[0]
    prompt = first_turn + _prompts(1, seed=6, lo=30, hi=31)[0]
    params = dataclasses.replace(GREEDY, max_tokens=8)
    want = generate(model, prompt, 8, temperature=0)
    pre = Engine(model, None, EngineConfig(max_model_len=96))
    pre.add_request(prompt, params, "p", prefill_only=True)
    outs = []
    while pre.has_unfinished():
        outs += pre.step()
    (o,) = outs
    held = 32                                       # two whole blocks of the first turn
    shipped = type(o.state).unflatten(o.state.suffix(held, model.state_specs).flatten())
    assert shipped.start == held and shipped.nbytes < o.state.nbytes
    dec, cold = (Engine(model, None, EngineConfig(max_model_len=96)) for _ in range(2))
    dec.generate([first_turn], params)              # the first turn, cached
    for eng in (dec, cold):
        seq = eng.add_prefilled(prompt, o.token_ids[0], shipped.clone(), params)
        while eng.has_unfinished():
            eng.step()
        assert seq.output_ids == want
    assert (dec.scheduler.shipped_prefix_hits, dec.scheduler.shipped_prefix_misses) == (1, 0)
    assert (cold.scheduler.shipped_prefix_hits, cold.scheduler.shipped_prefix_misses) == (0, 1)
    # a prefix that ends inside a block cannot be shared by blocks: computed there instead
    odd = Engine(model, None, EngineConfig(max_model_len=96))
    odd.generate([first_turn], params)
    seq = odd.add_prefilled(prompt, o.token_ids[0], o.state.suffix(held - 3, model.state_specs),
                            params)
    while odd.has_unfinished():
        odd.step()
    assert seq.output_ids == want and odd.scheduler.shipped_prefix_misses == 1
    pc = dec.scheduler.prefix_cache
    assert pc.kv_blocks(prompt[:len(prompt) // 16 * 16]) is not None   # the whole prompt
    with pytest.raises(ValueError, match="start"):
        o.state.suffix(len(prompt) + 1, model.state_specs)
    with pytest.raises(ValueError, match="cannot run"):
        model.prefill(torch.tensor(prompt[:4]), shipped.clone())


def test_one_token_prompt_starts_from_a_clean_state_slot():
    """A one-token prompt is scheduled as a decode; its slot must not keep the recurrent
    state of the sequence that used it before."""
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    eng = Engine(model, None, EngineConfig(max_model_len=64))
    (first,) = eng.generate([[7]], GREEDY)
    eng.generate([[1, 2, 3, 4]], GREEDY)
    (again,) = eng.generate([[7]], GREEDY)
    assert again.output_ids == first.output_ids == generate(model, [7], 12, temperature=0)


def test_generation_config_end_ids_stop_like_eos():
    """A model whose generation_config lists several end ids stops at any of them (unless
    ignore_eos), as transformers' generate does."""
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    prompt = [5, 6, 7]
    free = generate(model, prompt, 12, temperature=0)
    tok = ByteTokenizer()
    tok.stop_ids = (free[2],)
    eng = Engine(model, tok, EngineConfig(max_model_len=64))
    params = SamplingParams(max_tokens=12, temperature=0)
    (seq,) = eng.generate([prompt], params)
    assert seq.output_ids == free[:free.index(free[2]) + 1]
    (seq,) = eng.generate([prompt], dataclasses.replace(params, ignore_eos=True))
    assert seq.output_ids == free


@pytest.mark.parametrize("layers", ["GGGA", "GGGG", "AA"])
def test_a_chat_s_next_turn_resumes_after_the_answer(layers):
    """Turn k + 1 repeats turn k's prompt and answer: the cache covers both, to the last full
    block of what turn k computed (the answer's blocks and the rolling snapshot), and the
    tokens equal the model's own loop's."""
    model = _model(layers)
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=256, max_num_seqs=2))
    prompt = _prompts(1, seed=5, lo=40, hi=41)[0]
    answer = SamplingParams(max_tokens=29, temperature=0, ignore_eos=True)
    computed = 0            # tokens the previous turn computed (its prompt and answer)
    for turn, extra in enumerate(_prompts(3, seed=6, lo=5, hi=12)):
        (seq,) = eng.generate([prompt], answer)
        assert seq.output_ids == generate(model, prompt, 29, temperature=0)
        if turn:
            assert seq.num_cached_tokens == (computed - 1) // 16 * 16
        computed = len(prompt) + len(seq.output_ids)
        prompt = prompt + seq.output_ids + extra
    if "G" in layers:   # one rolling snapshot per answer, not one per block of it
        assert len(eng.scheduler.prefix_cache.snapshots) <= 2 * 3


def test_random_cancels_leave_the_cache_consistent():
    """200 requests sharing prefixes, many cancelled mid-prefill or mid-decode at random:
    every slot and block is freed, and a cached prefix then serves the same tokens as a
    fresh engine."""
    model = _model("GGGA")
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=256, max_num_seqs=4,
                                                      snapshot_interval=16,
                                                      num_state_snapshots=64,
                                                      max_num_batched_tokens=48))
    rng = torch.Generator().manual_seed(9)
    stems = _prompts(4, seed=7, lo=30, hi=80)
    live = []
    for i in range(200):
        stem = stems[i % 4]
        cut = int(torch.randint(10, len(stem) + 1, (1,), generator=rng))
        tail = torch.randint(0, 256, (3,), generator=rng).tolist()
        live.append(eng.add_request(stem[:cut] + tail, dataclasses.replace(
            GREEDY, max_tokens=int(torch.randint(1, 40, (1,), generator=rng)))))
        for _ in range(int(torch.randint(0, 3, (1,), generator=rng))):
            eng.step()
        if live and torch.rand(1, generator=rng) < 0.6:
            eng.abort(live.pop(int(torch.randint(0, len(live), (1,), generator=rng))).request_id)
    while eng.has_unfinished():
        eng.step()
    assert eng.scheduler.pool.num_used == 0
    assert all(r == 0 for r in eng.scheduler.blocks.ref_count)
    prompts = [s + [7, 8, 9] for s in stems]
    cached = eng.generate(prompts, GREEDY)
    assert any(s.num_cached_tokens for s in cached)
    assert [s.output_ids for s in cached] == [generate(model, p, 12, temperature=0)
                                              for p in prompts]


def test_snapshot_budget_and_interval_flags():
    model = _model("GGGA")
    one = sum(spec.fixed_bytes() for spec in model.state_specs)
    eng = Engine(model, None, EngineConfig(prefix_cache_memory=5 * one + 1))
    assert eng.scheduler.prefix_cache.num_snapshots == 5
    assert {t.shape[0] for layer in eng.runner.snapshots for t in layer.values()} == {5}
    with pytest.raises(ValueError, match="snapshot-interval must be a multiple"):
        Engine(model, None, EngineConfig(snapshot_interval=40))
    with pytest.raises(ValueError, match="--prefix-cache-memory .* more than half"):
        Engine(model, None, EngineConfig(prefix_cache_memory=1 << 50))
    off = Engine(model, None, EngineConfig(prefix_cache_memory=5 * one,
                                           enable_prefix_caching=False))
    assert off.snapshot_bytes == 0 and off.scheduler.prefix_cache is None


def test_a_flood_of_distinct_prefixes_stays_within_the_cache_s_budget():
    """300 distinct prompts: the snapshots never outgrow their slots (the buffers keep their
    size), the cache's KV entries never outnumber the blocks, and a prompt seen long ago
    still decodes exactly (from a hit or from scratch)."""
    model = _model("GGGA")
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, max_num_seqs=4,
                                                      num_state_snapshots=6,
                                                      snapshot_interval=16))
    sizes = [t.shape for layer in eng.runner.snapshots for t in layer.values()]
    pc, blocks = eng.scheduler.prefix_cache, eng.scheduler.blocks
    prompts = _prompts(300, seed=11, lo=17, hi=60)
    for i in range(0, 300, 4):
        eng.generate(prompts[i:i + 4], dataclasses.replace(GREEDY, max_tokens=3))
        assert len(pc.snapshots) <= 6 and len(pc.kv) <= blocks.num_blocks
    assert [t.shape for layer in eng.runner.snapshots for t in layer.values()] == sizes
    (again,) = eng.generate([prompts[0]], GREEDY)
    assert again.output_ids == generate(model, prompts[0], 12, temperature=0)

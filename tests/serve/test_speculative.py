"""Speculative decoding by n-gram drafts: the output is the model's own greedy output, token
for token, whatever the drafts, the layer kinds (recurrent states restored on rejection),
stops inside a draft, full KV blocks, a prefix cache and cancels."""

import dataclasses

import pytest
import torch

from hyla.data.tokenizer import ByteTokenizer
from hyla.model import HylaLM, preset
from hyla.model.generate import generate
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams
from hyla.serve.speculative import ngram_drafts

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _model(layers, seed=0):
    torch.manual_seed(seed)
    return HylaLM(dataclasses.replace(preset("debug"), layers=layers)).eval()


def _repetitive(seed=1, n=24):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (n,), generator=g).tolist()
    return base + base[: n // 2] + [7] + base[: n // 2]


def test_ngram_drafts():
    assert ngram_drafts([1, 2, 3, 9, 8, 1, 2, 3], 2) == [9, 8]
    assert ngram_drafts([4, 5, 6, 4, 5], 4, max_n=2) == [6, 4, 5]
    assert ngram_drafts([1, 2, 3], 3) == [] and ngram_drafts([1, 1], 0) == []
    assert ngram_drafts(list(range(100)) + [5], 2) == [6, 7]        # down to one token


def oracle_drafts(monkeypatch, model, prompts, n=40):
    """Drafts from the model's own greedy continuation, spoiled at some steps (one wrong
    token partway, or all wrong), so every path runs: all kept, some kept, none kept."""
    import hyla.serve.speculative as engine_module

    truth = {tuple(p): generate(model, p, n, temperature=0) for p in prompts}

    def drafts(tokens, k, **_):
        for p, out in truth.items():
            if tuple(tokens[:len(p)]) == p:
                at = len(tokens) - len(p)
                d = list(out[at:at + k])
                if at % 5 == 0:
                    d = [(t + 1) % 256 for t in d]
                elif at % 3 == 0 and len(d) > 1:
                    d[1] = (d[1] + 1) % 256
                return d
        return []
    monkeypatch.setattr(engine_module, "ngram_drafts", drafts)


@pytest.mark.parametrize("layers", ["GGGA", "AA", "GGGG", "GDGA"])
@pytest.mark.parametrize("cfg", [dict(), dict(num_speculative_tokens=1),
                                 dict(num_speculative_tokens=7, snapshot_interval=16),
                                 dict(num_kv_blocks=6)],
                         ids=["k4", "k1", "k7-snapshots", "few-blocks"])
def test_output_is_the_model_s_greedy_output(monkeypatch, layers, cfg):
    model = _model(layers)
    oracle_drafts(monkeypatch, model, [_repetitive(s) for s in range(3)])
    if "A" not in layers:
        cfg = {k: v for k, v in cfg.items() if k != "num_kv_blocks"}
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, speculative="ngram",
                                                      **cfg))
    prompts = [_repetitive(s) for s in range(3)]
    for p in prompts:
        (seq,) = eng.generate([p], GREEDY)
        assert seq.output_ids == generate(model, p, 40, temperature=0)
    assert 0 < eng.stats["accepted_tokens"] <= eng.stats["draft_tokens"]
    assert eng.scheduler.pool.num_used == 0
    if eng.scheduler.blocks is not None:
        assert all(r == 0 for r in eng.scheduler.blocks.ref_count)


def test_stops_inside_a_draft_and_max_tokens(monkeypatch):
    model = _model("GGGA")
    prompt = _repetitive(4)
    oracle_drafts(monkeypatch, model, [prompt])
    plain = generate(model, prompt, 40, temperature=0)
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, speculative="ngram",
                                                      num_speculative_tokens=6))
    stop = plain[17]
    (seq,) = eng.generate([prompt], dataclasses.replace(GREEDY, stop_token_ids=(stop,)))
    assert seq.output_ids == plain[:plain.index(stop) + 1] and seq.finish_reason == "stop"
    for n in (1, 2, 5):
        (seq,) = eng.generate([prompt], dataclasses.replace(GREEDY, max_tokens=n))
        assert seq.output_ids == plain[:n] and seq.finish_reason == "length"


def test_what_it_does_not_apply_to_runs_as_before():
    """Logprobs and batches of several decode as without speculation."""
    model = _model("GGGA")
    prompts = [_repetitive(s) for s in range(2)]
    spec = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, speculative="ngram"))
    plain = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128))
    scored = dataclasses.replace(GREEDY, logprobs=2)
    a, b = spec.generate([prompts[0]], scored), plain.generate([prompts[0]], scored)
    assert a[0].output_ids == b[0].output_ids
    both = spec.generate(prompts, GREEDY)
    assert [s.output_ids for s in both] == [generate(model, p, 40, temperature=0)
                                            for p in prompts]
    assert spec.stats["draft_tokens"] == 0


def test_cancels_mid_speculation_leave_the_cache_consistent():
    """200 greedy requests on repeated prefixes, many cancelled between steps: every slot
    and block freed, and cached prefixes then decode exactly."""
    model = _model("GGGA")
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=160, max_num_seqs=1,
                                                      speculative="ngram",
                                                      num_state_snapshots=32))
    rng = torch.Generator().manual_seed(5)
    stems = [_repetitive(s, 20) for s in range(4)]
    live = []
    for i in range(200):
        cut = int(torch.randint(12, len(stems[i % 4]) + 1, (1,), generator=rng))
        live.append(eng.add_request(stems[i % 4][:cut], dataclasses.replace(
            GREEDY, max_tokens=int(torch.randint(2, 30, (1,), generator=rng)))))
        for _ in range(int(torch.randint(0, 4, (1,), generator=rng))):
            eng.step()
        if torch.rand(1, generator=rng) < 0.5:
            eng.abort(live.pop(int(torch.randint(0, len(live), (1,), generator=rng))).request_id)
    while eng.has_unfinished():
        eng.step()
    assert eng.scheduler.pool.num_used == 0
    assert all(r == 0 for r in eng.scheduler.blocks.ref_count)
    assert eng.stats["draft_tokens"] > 0
    for stem in stems:
        (seq,) = eng.generate([stem], GREEDY)
        assert seq.output_ids == generate(model, stem, 40, temperature=0)


def test_drafts_that_keep_failing_back_off():
    """A request whose drafts all fail drafts again after 1, 2, 4 ... 64 plain steps: on
    text that never repeats, speculation costs next to nothing."""
    import hyla.serve.speculative as engine_module

    model = _model("GGGA")
    calls = []

    def wrong(tokens, k, **_):
        calls.append(len(tokens))
        return [(tokens[-1] + 1) % 256] * k        # never what this model says (checked)
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=256, speculative="ngram"))
    prompt = _repetitive(2)
    want = generate(model, prompt, 100, temperature=0)
    old, engine_module.ngram_drafts = engine_module.ngram_drafts, wrong
    try:
        (seq,) = eng.generate([prompt], dataclasses.replace(GREEDY, max_tokens=100))
    finally:
        engine_module.ngram_drafts = old
    assert seq.output_ids == want
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert eng.stats["accepted_tokens"] == 0 and len(calls) <= 9
    assert gaps[:5] == [2, 3, 5, 9, 17]          # a step, then waits of 1, 2, 4, 8, 16


def test_draft_counts_grow_while_kept_and_fall_back_to_one():
    """1 draft, then 3, then k while every draft is kept; back to 1 after a step that keeps
    none (after its back-off)."""
    from hyla.serve.speculative import NgramDrafter

    d, tokens = NgramDrafter(4), list(range(20)) * 2
    sizes = []
    for kept in (True, True, True, False, None):
        drafts = d.draft(tokens, room=10)
        sizes.append(len(drafts))
        if kept is not None:
            d.feedback(len(drafts) if kept else 0, len(drafts))
    assert sizes == [1, 3, 4, 4, 0] and d.draft(tokens, room=10) == [0]


def _compiled_pair(monkeypatch, layers, scheme, n):
    """A model (quantised by ``scheme``), ``n`` repetitive prompts with oracle drafts, a
    plain and a speculative compiled engine (warmed up: ``built`` graphs), and the rows'
    slots of every decode call the speculative one makes (``batches``)."""
    from hyla.model.quantize import quantize_model

    model = _model(layers)
    if scheme:
        quantize_model(model, scheme)
    prompts = [_repetitive(s) for s in range(n)]
    oracle_drafts(monkeypatch, model, prompts)
    config = EngineConfig(max_model_len=128, max_num_seqs=4, compile=True)
    plain = Engine(model, ByteTokenizer(), config)
    eng = Engine(model, ByteTokenizer(), dataclasses.replace(config, speculative="ngram"))
    built = eng.warmup()
    batches = []
    decode = eng.runner._decode
    monkeypatch.setattr(eng.runner, "_decode", lambda slots, *a, **kw: (
        batches.append(list(slots)), decode(slots, *a, **kw))[1])
    return model, prompts, plain, eng, built, batches


@pytest.mark.parametrize("layers, scheme", [("AA", None), ("GA", None), ("AA", "int8"),
                                           ("AA", "int4-a8")])
def test_compiled_engines_verify_drafts_as_a_decode_batch(monkeypatch, layers, scheme):
    """Compiled, a model without fixed-size state verifies its drafts as one of the decode
    widths (the one sequence's rows at consecutive positions, no eager prefill pass), drafts
    cut to fill a width (4 of them would need width 8: 3). A float model runs the decode
    graphs; a quantised one graphs of its own in one row's products, built by warmup. One
    with a GLA state verifies them as a prefill chunk. All keep the plain output."""
    model, prompts, plain, eng, built, batches = _compiled_pair(monkeypatch, layers, scheme,
                                                                2)
    for p in prompts:
        (seq,) = eng.generate([p], GREEDY)
        assert seq.output_ids == plain.generate([p], GREEDY)[0].output_ids
        if scheme is None:
            assert seq.output_ids == generate(model, p, 40, temperature=0)
    assert eng.runner.num_compilations == built and eng.stats["accepted_tokens"] > 0
    verified = [b for b in batches if len(b) > 1]
    assert bool(verified) == (layers == "AA")
    assert all(len(set(b)) == 1 and len(b) in (2, 4) for b in verified)
    assert eng.runner.built_verify_widths == ({2, 4} if scheme else set())


@pytest.mark.parametrize("layers, scheme", [("AA", None), ("AA", "int4-a8"), ("GA", None)])
def test_several_decoding_requests_verify_their_drafts_in_one_batch(monkeypatch, layers,
                                                                     scheme):
    """Compiled, without fixed-size state: three requests decoding together verify their
    drafts in one decode batch of the decode graphs (each one's rows at consecutive
    positions, within the widest width; quantised, in a batch's products, as their plain
    steps together take), keeping the plain engine's tokens. With a GLA state they take
    plain steps while more than one decodes."""
    _, prompts, plain, eng, built, batches = _compiled_pair(monkeypatch, layers, scheme, 3)
    want = [s.output_ids for s in plain.generate(prompts, GREEDY)]
    assert [s.output_ids for s in eng.generate(prompts, GREEDY)] == want
    assert eng.runner.num_compilations == built
    mixed = [b for b in batches if len(set(b)) > 1 and len(b) > len(set(b))]
    assert bool(mixed) == (layers == "AA")
    assert all(len(b) <= 4 for b in batches)
    if layers == "AA":
        assert eng.stats["accepted_tokens"] > 0


def test_bad_settings_are_refused_naming_the_flag():
    model = _model("GGGA")
    with pytest.raises(ValueError, match="--speculative: expected one of"):
        Engine(model, None, EngineConfig(speculative="eagle"))
    with pytest.raises(ValueError, match="--num-speculative-tokens must be >= 1"):
        Engine(model, None, EngineConfig(speculative="ngram", num_speculative_tokens=0))


def test_metrics_count_cache_hits_and_drafts(monkeypatch):
    """/metrics counters follow the engine's totals, once each, however often it renders."""
    from prometheus_client.parser import text_string_to_metric_families

    from hyla.serve.metrics import EngineMetrics

    model = _model("GGGA")
    prompt = _repetitive(3)
    oracle_drafts(monkeypatch, model, [prompt])
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, speculative="ngram"))
    metrics = EngineMetrics()
    for _ in range(2):
        eng.generate([prompt], GREEDY)
        metrics.render(eng)
    values = {s.name: s.value for f in text_string_to_metric_families(
        metrics.render(eng).decode()) for s in f.samples}
    pc = eng.scheduler.prefix_cache
    assert values["hyla_prefix_cache_hit_tokens_total"] == pc.hit_tokens > 0
    assert values["hyla_prefix_cache_query_tokens_total"] == pc.query_tokens
    assert values["hyla_spec_draft_tokens_total"] == eng.stats["draft_tokens"] > 0
    assert values["hyla_spec_accepted_tokens_total"] == eng.stats["accepted_tokens"] > 0


class _Oracle:
    """Drafts from the model's own greedy continuation, every third step spoiled at one
    place, so all-kept, some-kept and none-kept verifications all run."""

    def __init__(self, want: list[int], prompt_len: int, k: int):
        self.want, self.n0, self.k, self.calls = want, prompt_len, k, 0
        self.drafted = self.accepted = 0

    def draft(self, tokens, room):
        done = len(tokens) - self.n0
        out = self.want[done:done + min(self.k, room)]
        self.calls += 1
        if self.calls % 3 == 0 and out:
            out = out[:len(out) // 2] + [(out[len(out) // 2] + 1) % 256] + \
                out[len(out) // 2 + 1:]
        return out

    def feedback(self, accepted, drafted=None):
        self.accepted += accepted
        self.drafted += drafted or 0


@pytest.mark.parametrize("layers", ["GGGA", "AA", "GDGA"])
@pytest.mark.parametrize("k", [1, 4])
def test_streamed_generation_with_drafts_is_plain_greedy(layers, k):
    """``hyla generate``'s and ``hyla chat``'s loop (stream_tokens over a RunnerState): with
    drafts, verified and rolled back, the tokens are the plain greedy ones, stop ids and
    max_tokens included."""
    from hyla.model.stream import StreamTiming, stream_tokens
    from hyla.serve.session import RunnerState
    from hyla.serve.speculative import NgramDrafter

    model = _model(layers)
    prompt = _repetitive()
    want = list(stream_tokens(model, RunnerState(model), prompt, 30, temperature=0))
    oracle = _Oracle(want, len(prompt), k)
    got = list(stream_tokens(model, RunnerState(model), prompt, 30, temperature=0,
                             drafter=oracle))
    assert got == want and oracle.accepted > 0 and oracle.accepted < oracle.drafted
    stop = want[12]
    cut = want[:want.index(stop)]
    timing = StreamTiming()
    got = list(stream_tokens(model, RunnerState(model), prompt, 30, temperature=0,
                             stop_ids=[stop], timing=timing, drafter=_Oracle(want, len(prompt), k)))
    assert got == cut and timing.stopped
    state = RunnerState(model)
    got = list(stream_tokens(model, state, prompt, 7, temperature=0, drafter=NgramDrafter(k)))
    assert got == want[:7] and state.num_tokens == len(prompt) + 6     # the last: not fed


def test_chat_with_speculation_keeps_its_state_between_turns():
    from hyla.cli.chat import Conversation
    from hyla.serve.draft_model import ModelDrafter
    from hyla.serve.speculative import NgramDrafter

    class Seen(NgramDrafter):
        """Records what it was shown."""
        def draft(self, tokens, room):
            self.shown = list(tokens)
            return super().draft(tokens, room)

    model = _model("GGGA")
    replies = []
    for d in (None, Seen(4), ModelDrafter(_model("GGGA", seed=1), 3)):
        chat = Conversation(model, ByteTokenizer(), max_tokens=24, temperature=0, drafter=d)
        turns = ["".join(chat.reply("abcabcabc"))]
        first = list(chat.read)
        assert len(first) == chat.state.num_tokens
        turns.append("".join(chat.reply("abcabc again")))
        assert len(chat.read) == chat.state.num_tokens and chat.read[:len(first)] == first
        if isinstance(d, Seen):     # the drafter saw the whole conversation, turn 1 too
            assert d.shown[:len(first)] == first
        replies.append(turns)
        assert not chat.last["reread"]
    assert replies[0] == replies[1] == replies[2]


def test_sampled_drafts_keep_the_model_s_distribution():
    """The speculative sampling rule: whatever the drafts, each emitted token is
    distributed as plain sampling's (first token: p0; second, when the first draft was
    kept, p1), to within sampling noise over 20,000 draws."""
    from types import SimpleNamespace

    from hyla.model.sampler import accept_drafts

    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    params = SimpleNamespace(temperature=0.9, top_k=5, top_p=1.0)
    p = [torch.softmax(
        torch.where(r >= torch.topk(r, 5).values[-1], r, float("-inf")) / 0.9, -1)
        for r in logits.double()]
    g = torch.Generator().manual_seed(1)
    n, first, second = 20_000, torch.zeros(6), torch.zeros(6)
    for _ in range(n):
        j, after = accept_drafts(logits, [2, 4], params, g)
        first[2 if j >= 1 else after] += 1
        if j >= 1:
            second[4 if j == 2 else after] += 1
    assert (first / n - p[0]).abs().sum() < 0.03
    assert (second / second.sum() - p[1]).abs().sum() < 0.05


def test_sampled_requests_speculate_and_repeat_with_a_seed(monkeypatch):
    """Drafts for a sampled request (any drafts: here the sequence's last tokens again)
    run the verify path, free everything, and a seed gives the same tokens twice."""
    import hyla.serve.speculative as speculative

    monkeypatch.setattr(speculative, "ngram_drafts", lambda tokens, k, **kw: tokens[-k:])
    model = _model("GGGA")
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, speculative="ngram",
                                                      enable_prefix_caching=False))
    params = SamplingParams(max_tokens=30, temperature=0.3, seed=3, ignore_eos=True)
    prompt = _repetitive(2)
    a, b = (eng.generate([prompt], params)[0] for _ in range(2))
    assert a.output_ids == b.output_ids and len(a.output_ids) == 30
    assert eng.stats["draft_tokens"] > 0 and eng.scheduler.pool.num_used == 0


@pytest.mark.parametrize("layers, scheme", [
    ("AA", "int4"), ("AA", "int8"), ("GA", "int4"), ("DA", "int4-a8"), ("SC", "int8"),
    ("KA", "int4"), ("AA-window", "int4"), ("GA-moe", "int8")])
def test_an_eager_verify_leaves_the_state_plain_steps_leave(layers, scheme):
    """Eager, a quantised model verifies its drafts as a decode batch of the one sequence,
    each row in a plain step's attention and one row's products, and a fixed-size state
    (GLA, gated delta, KDA, Mamba-2, a conv window, a window layer's ring) stepping through
    the rows one at a time, an MoE's experts too: the state it leaves (rejected drafts
    rolled back and the kept ones run again) is bitwise what plain greedy steps leave (a
    prefill chunk's attention and the delta rule's chunk form round otherwise: through bf16
    activations a greedy SmolLM2 int4 answer parted, and an int4 Qwen3.5-like one at a
    near-tie; an MoE's experts over grouped rows left a quantised MiMo other KV rows).
    (Float32 matmuls of several rows round otherwise than one row's, ~1e-5: not bitwise.)"""
    from hyla.model.quantize import quantize_model
    from hyla.model.stream import stream_tokens
    from hyla.serve.session import RunnerState

    window, moe = layers.endswith("-window"), layers.endswith("-moe")
    torch.manual_seed(0)
    model = HylaLM(dataclasses.replace(
        preset("debug"), layers=layers[:2],
        layer_overrides=[{}, {"sliding_window": 8}] if window else None,
        ffn_layers="EE" if moe else None,       # MiMo's router: its experts stay float
        ffn_options={"moe": {"num_experts": 8, "top_k": 3, "expert_dim": 32,
                             "router": "sigmoid", "score_bias": True, "n_group": 4,
                             "topk_group": 2}} if moe else {})).eval()
    quantize_model(model, scheme)
    prompt = _repetitive()
    states = [RunnerState(model), RunnerState(model)]
    oracle = _Oracle(list(stream_tokens(model, RunnerState(model), prompt, 30, temperature=0)),
                     len(prompt), 3)
    plain = list(stream_tokens(model, states[0], prompt, 30, temperature=0))
    spec = list(stream_tokens(model, states[1], prompt, 30, temperature=0, drafter=oracle))
    assert plain == spec and 0 < oracle.accepted < oracle.drafted
    n = states[0].num_tokens
    runner = states[0].runner
    for spec_, a, b in zip(runner.specs, runner.buffers, states[1].runner.buffers,
                           strict=True):
        for e in spec_.fixed:
            assert torch.equal(a[e.name][0], b[e.name][0]), e.name
        for e in spec_.per_token:
            rows = [t[e.name].reshape(-1, *t[e.name].shape[2:])[:n] for t in (a, b)]
            assert torch.equal(*rows), e.name

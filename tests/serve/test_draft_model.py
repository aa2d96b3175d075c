"""Speculative decoding with a draft model (``--speculative draft:SOURCE``): the output is
the target's own greedy output, the draft model's state is taken back exactly after
rejected drafts, and a draft that cannot draft for the target is refused naming why."""

import copy
import dataclasses

import pytest
import torch

from hyla.data.tokenizer import ByteTokenizer
from hyla.model import HylaLM, preset
from hyla.model.generate import generate
from hyla.serve.draft_model import ModelDrafter, check_draft_vocab
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams
from hyla.serve.session import RunnerState

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _model(layers, seed=0, **kw):
    torch.manual_seed(seed)
    return HylaLM(dataclasses.replace(preset("debug"), layers=layers, **kw)).eval()


def _near(model, noise, seed=1):
    """A draft that mostly agrees with ``model``: its weights plus a little noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().nan_to_num(0))
    return draft


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23, 40)]


@pytest.mark.parametrize("target, draft", [("GGGA", "GGGA"), ("GDGA", "AA"), ("AA", "GA")])
def test_output_is_the_target_s_greedy_output(target, draft):
    """Drafts from a model near the target (some kept, some rejected) and from an unrelated
    one (almost all rejected): token for token the target's greedy output, with the draft's
    and the target's recurrent states taken back after each rejection."""
    model = _model(target)
    near = _near(model, 0.05) if draft == target else _model(draft, seed=4)
    eng = Engine(model, ByteTokenizer(), EngineConfig(
        max_model_len=128, speculative="draft:-", num_speculative_tokens=3), draft_model=near)
    for prompt in _prompts():
        (seq,) = eng.generate([prompt], GREEDY)
        assert seq.output_ids == generate(model, prompt, 32, temperature=0)
    drafted, kept = eng.stats["draft_tokens"], eng.stats["accepted_tokens"]
    assert drafted > 0 and kept < drafted
    if draft == target:
        assert kept > drafted // 4


@pytest.mark.parametrize("layers", ["GGGA", "AA", "GDGA"])
def test_the_draft_state_is_taken_back_exactly(layers):
    """After drafts the target partly rejected, the draft model's next logits are those of
    a fresh state fed the true sequence: nothing rejected stays in its state."""
    draft = _model(layers, seed=2)
    drafter = ModelDrafter(draft, 4)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 256, (9,), generator=g).tolist()
    for _ in range(12):
        drafts = drafter.draft(seq, room=4)
        kept = int(torch.randint(0, len(drafts) + 1, (1,), generator=g))
        drafter.feedback(kept, len(drafts))
        seq += drafts[:kept] + [int(torch.randint(0, 256, (1,), generator=g))]
    with torch.inference_mode():
        got = drafter._sync(seq)
        want = RunnerState(draft).prefill(seq)
    assert drafter.state.num_tokens == len(seq) == len(drafter.fed)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_unsure_drafts_are_not_drafted():
    """At confidence 0.99 a random model (nearly uniform) drafts nothing; at 0 it drafts
    what the ramp allows."""
    draft = _model("GGGA")
    unsure = ModelDrafter(draft, 3, confidence=0.99)
    assert unsure.draft([1, 2, 3], room=8) == []
    assert unsure.waiting() and not unsure.waiting()    # then waits a step, as after a miss
    assert unsure.draft([1, 2, 3], room=8) == [] and unsure._wait == 2
    sure = ModelDrafter(draft, 3)
    assert len(sure.draft([1, 2, 3], room=8)) == 1          # one, to begin with
    sure.feedback(1, 1)                                     # all kept: then k
    assert len(sure.draft([1, 2, 3], room=8)) == 3
    assert ModelDrafter(draft, 3).draft([1, 2, 3], room=0) == []


def test_streamed_generation_with_a_draft_model_is_plain_greedy():
    """``hyla generate``'s and ``hyla chat``'s loop with a draft model."""
    from hyla.model.stream import stream_tokens

    model = _model("GDGA")
    prompt = _prompts()[1]
    want = list(stream_tokens(model, RunnerState(model), prompt, 30, temperature=0))
    drafter = ModelDrafter(_near(model, 0.05), 4)
    got = list(stream_tokens(model, RunnerState(model), prompt, 30, temperature=0,
                             drafter=drafter))
    assert got == want and 0 < drafter.accepted < drafter.drafted


def test_a_draft_that_cannot_draft_for_the_target_is_refused():
    model = _model("GGGA")

    class Other(ByteTokenizer):
        def encode(self, text):
            return [t ^ 1 for t in super().encode(text)]
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        check_draft_vocab(model, Other(), model, ByteTokenizer())
    wider = _model("GGGA", vocab_size=512)
    with pytest.raises(ValueError, match="vocabulary has 512 tokens, the target's 256"):
        check_draft_vocab(wider, None, model, None)
    with pytest.raises(ValueError, match="draft:SOURCE needs a model after 'draft:'"):
        Engine(model, None, EngineConfig(speculative="draft:"))
    with pytest.raises(ValueError, match=r"expected one of \('ngram', 'mtp', 'draft:SOURCE'\)"):
        Engine(model, None, EngineConfig(speculative="eagle"))
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        Engine(model, None, EngineConfig(speculative="mtp"))
    with pytest.raises(ValueError, match="confidence must be in"):
        ModelDrafter(model, 2, confidence=1.0)


def test_cancels_mid_speculation_free_the_draft_state():
    """Requests cancelled between speculative steps leave no drafter behind, every slot and
    block free, and later requests decode exactly."""
    model = _model("GGGA")
    eng = Engine(model, ByteTokenizer(), EngineConfig(
        max_model_len=128, max_num_seqs=1, speculative="draft:-", num_speculative_tokens=2),
        draft_model=_near(model, 0.05))
    prompts = _prompts()
    for i in range(20):
        seq = eng.add_request(prompts[i % 3], GREEDY)
        for _ in range(i % 4 + 1):
            eng.step()
        eng.abort(seq.request_id)
    assert eng.stats["draft_tokens"] > 0
    assert not eng.speculator._drafters
    assert eng.scheduler.pool.num_used == 0
    (seq,) = eng.generate([prompts[2]], GREEDY)
    assert seq.output_ids == generate(model, prompts[2], 32, temperature=0)


@pytest.mark.parametrize("layers", ["GDGA", "AA"])
def test_drafters_taking_turns_on_one_slot_draft_as_alone(layers):
    """Two drafters sharing one draft slot in turn: each turn lends the slot to the other,
    which starts again from its sequence, and drafts what a drafter of its own would."""
    from hyla.serve.draft_model import DraftSlots

    draft = _model(layers, seed=2)
    slots = DraftSlots(draft, max_model_len=128, slots=1)
    shared = [ModelDrafter(draft, 3, slots=slots) for _ in range(2)]
    alone = [ModelDrafter(draft, 3) for _ in range(2)]
    seqs = [p[:9] for p in _prompts()[1:]]
    for turn in range(6):
        i = turn % 2
        got, want = shared[i].draft(seqs[i], 3), alone[i].draft(seqs[i], 3)
        assert got == want
        seqs[i] = seqs[i] + got[:turn % 3] + [turn]
    assert slots._owner[0] is shared[1]
    shared[1].close()
    assert slots._free == [0] and not slots._owner


def test_a_compiled_engine_drafts_on_a_compiled_draft_step():
    """Compiled (fixed shapes): the draft's one-row step is built by the warm-up and the
    output stays the target's greedy output."""
    model = _model("AA")
    eng = Engine(model, ByteTokenizer(), EngineConfig(
        max_model_len=64, max_num_seqs=2, speculative="draft:-", num_speculative_tokens=3,
        compile=True),
        draft_model=_near(model, 0.05))
    eng.warmup()
    assert 1 in eng.draft_slots.runner.built_widths
    built = eng.draft_slots.runner.num_compilations
    prompt = _prompts()[1]
    (seq,) = eng.generate([prompt], GREEDY)
    assert seq.output_ids == generate(model, prompt, 32, temperature=0)
    assert eng.stats["accepted_tokens"] > 0
    assert eng.draft_slots.runner.num_compilations == built


def test_a_restarted_engine_keeps_its_draft_model():
    """After a failed step the server's engine is rebuilt: with the draft model it had (not
    SOURCE loaded again, unquantised), and it drafts as before."""
    from hyla.serve.async_engine import AsyncEngine

    model = _model("GGGA")
    draft = _near(model, 0.05)
    ae = AsyncEngine(Engine(model, ByteTokenizer(), EngineConfig(
        max_model_len=128, speculative="draft:/no/such/model"), draft_model=draft))
    try:
        assert ae._restart(RuntimeError("simulated forward failure"))
        assert ae.engine.draft_model is draft and ae.restarts == 1
    finally:
        ae.shutdown()
    prompt = _prompts()[1]
    (seq,) = ae.engine.generate([prompt], GREEDY)
    assert seq.output_ids == generate(model, prompt, 32, temperature=0)
    assert ae.engine.stats["accepted_tokens"] > 0


def test_the_memory_breakdown_counts_the_draft_model():
    from hyla.serve.memory_report import breakdown, describe

    model = _model("GGGA")
    draft = _model("AA", seed=3)
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=64, speculative="draft:-"),
                 draft_model=draft)
    parts = breakdown(eng)
    assert parts["draft_model"] == sum(p.numel() * p.element_size() for p in draft.parameters())
    assert "+ draft model" in describe(parts)
    # its two slots' keys and values for max_model_len tokens each, in both layers
    c = draft.cfg
    assert parts["draft_reserved"] >= 2 * 2 * 64 * 2 * c.n_kv_heads * c.head_dim * 4
    assert "its states" in describe(parts)
    assert "draft model" not in describe(breakdown(Engine(model, ByteTokenizer())))


def test_a_draft_with_a_wider_vocabulary_drafts_only_the_target_s_tokens():
    """A draft whose vocabulary is padded wider (its tokenizer the target's) never drafts a
    token past the target's vocabulary: the engine's output stays the target's greedy one."""
    model = _model("AA")
    wide = _model("AA", seed=5, vocab_size=512)
    wider = [ModelDrafter(wide, 3).draft(p, room=8) for p in _prompts()]
    assert any(t >= 256 for d in wider for t in d)      # what the cut-off has to stop
    for p in _prompts():
        drafts = ModelDrafter(wide, 3, vocab=256).draft(p, room=8)
        assert all(t < 256 for t in drafts)
    eng = Engine(model, ByteTokenizer(), EngineConfig(max_model_len=128, speculative="draft:-"),
                 draft_model=wide)
    (seq,) = eng.generate([_prompts()[1]], GREEDY)
    assert seq.output_ids == generate(model, _prompts()[1], 32, temperature=0)


def test_tokenizers_that_agree_on_the_probe_but_not_elsewhere_are_told_apart():
    """A probe text is not enough: one id's text, or the special ids, differing is found."""
    from hyla.serve.draft_model import PROBE_TEXT, tokenizer_difference

    class OneIdElsewhere(ByteTokenizer):
        def decode(self, ids):
            return "".join("x" if i == 200 else super(OneIdElsewhere, self).decode([i])
                           for i in ids)

    class OtherEnd(ByteTokenizer):
        eos_id = 7

    class SameEnd(ByteTokenizer):
        eos_id = 1

    plain = SameEnd()
    assert 200 not in plain.encode(PROBE_TEXT)
    assert tokenizer_difference(ByteTokenizer(), ByteTokenizer()) is None
    assert "its token 200 is 'x'" in tokenizer_difference(OneIdElsewhere(), ByteTokenizer())
    assert "its eos_id is 7, the target's 1" in tokenizer_difference(OtherEnd(), plain)
    model = _model("GGGA")
    with pytest.raises(ValueError, match=r"--speculative draft:d\.gguf: the draft model's "
                                         r"tokenizer differs .*its token 200"):
        check_draft_vocab(model, OneIdElsewhere(), model, ByteTokenizer(), "d.gguf")


def test_a_draft_that_keeps_failing_backs_off():
    """After verifies that keep none it drafts again only after 1, 2, 4 ... plain steps, and
    at once after one that keeps some; the state catches up on the next draft."""
    draft = _model("GDGA", seed=2)
    d = ModelDrafter(draft, 2)
    seq = _prompts()[1]
    waits = []
    for _ in range(4):
        assert d.draft(seq, room=4)
        d.feedback(0, 2)
        seq = seq + [1]
        n = 0
        while not d.draft(seq, room=4):
            n, seq = n + 1, seq + [2]
        waits.append(n)
    assert waits == [1, 2, 4, 8]
    d.feedback(1, 2)
    assert d.draft(seq + [3], room=4)
    with torch.inference_mode():
        torch.testing.assert_close(d._sync(seq + [3]), RunnerState(draft).prefill(seq + [3]),
                                   rtol=1e-4, atol=1e-4)


def test_chat_names_the_flag_when_the_draft_cannot_load(capsys, monkeypatch):
    import io

    from hyla.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", "--preset", "debug", "--temperature", "0", "--speculative",
                 "draft:/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "--speculative draft:/no/such/model: not found" in err and "json-schema" not in err

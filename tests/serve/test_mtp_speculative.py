"""Speculative decoding with the model's own MTP layers (``--speculative mtp``): a head
self-distilled on a small target drafts tokens the target keeps; the output is the
target's own greedy output, token for token, in the engine (alone, together, compiled,
after cancels) and in ``hyla generate``'s stream; the hidden-state log is taken back with
each request; a model saved with its head loads with it."""

import dataclasses
import random
import re

import pytest
import torch

from hyla.data.tokenizer import ByteTokenizer
from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import load_checkpoint, save_checkpoint
from hyla.model.generate import generate
from hyla.model.stream import stream_tokens
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.mtp_drafter import MTPDrafter
from hyla.serve.sequence import SamplingParams
from hyla.serve.session import RunnerState
from hyla.train.mtp_head import mtp_distill_step, with_mtp_head

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _prompts(n=3, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in (5, 23, 40)][:n]


@pytest.fixture(scope="module")
def oracle():
    """A one-block attention target whose MTP head is that block: ``fc`` passes the next
    token's embedding alone (unit-RMS rows, so the head's norm keeps them), and the head
    then runs the target's own block and norm on it, one position behind. Its drafts are
    the target's own next tokens but for the first token it never sees: nearly all kept,
    if drafting pairs the hidden states and tokens as training did."""
    torch.manual_seed(0)
    model = HylaLM(dataclasses.replace(preset("debug"), layers="A",
                                       initializer_range=0.1)).eval()
    with torch.no_grad():
        e = model.embed.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())
    model = with_mtp_head(model).eval()         # (its block: a copy of the target's)
    d = model.cfg.d_model
    with torch.no_grad():
        model.mtp.fc.weight.zero_()
        model.mtp.fc.weight[:, :d] = torch.eye(d)
        model.mtp.norm.load_state_dict(model.norm.state_dict())
    return model


@pytest.fixture(scope="module")
def trained():
    """A GLA + attention target (fixed-size state: rejected drafts are rolled back) with a
    head briefly self-distilled on its own greedy text: some drafts kept, some not."""
    torch.manual_seed(0)
    model = HylaLM(dataclasses.replace(preset("debug"), layers="GGGA")).eval()
    g = torch.Generator().manual_seed(1)
    rows = [generate(model, torch.randint(0, 256, (8,), generator=g).tolist(), 56,
                     temperature=0) for _ in range(16)]
    model = with_mtp_head(model)
    opt = torch.optim.AdamW(model.mtp.parameters(), lr=3e-3)
    data = torch.tensor(rows)
    for _ in range(150):
        mtp_distill_step(model, data[torch.randint(0, 16, (8,), generator=g)], opt)
    return model.eval()


@pytest.mark.parametrize("name", ["oracle", "trained"])
def test_engine_output_is_the_target_s(request, name):
    target = request.getfixturevalue(name)
    eng = Engine(target, ByteTokenizer(), EngineConfig(
        max_model_len=128, speculative="mtp", num_speculative_tokens=3))
    for prompt in _prompts():
        (seq,) = eng.generate([prompt], GREEDY)
        assert seq.output_ids == generate(target, prompt, 32, temperature=0)
    drafted, kept = eng.stats["draft_tokens"], eng.stats["accepted_tokens"]
    if name == "oracle":
        assert kept > 0.8 * drafted > 0, (kept, drafted)
    else:
        assert 0 < kept < drafted
    # together (plain steps: MTP drafts for a request decoding alone)
    seqs = eng.generate(_prompts(), GREEDY)
    assert [s.output_ids for s in seqs] == [generate(target, p, 32, temperature=0)
                                            for p in _prompts()]


@pytest.mark.parametrize("name", ["oracle", "trained"])
def test_stream_output_is_the_target_s(request, name):
    target = request.getfixturevalue(name)
    kept = drafted = 0
    for prompt in _prompts():
        d = MTPDrafter(target, 4)
        got = list(stream_tokens(target, RunnerState(target), prompt, 32, temperature=0,
                                 drafter=d))
        assert got == generate(target, prompt, 32, temperature=0)
        kept, drafted = kept + d.accepted, drafted + d.drafted
    assert drafted > 0 and (kept > 0.8 * drafted if name == "oracle" else kept < drafted)


def test_compiled_engine(oracle):
    eng = Engine(oracle, None, EngineConfig(max_model_len=128, speculative="mtp",
                                            num_speculative_tokens=3, compile=True,
                                            max_num_seqs=2, decode_widths=(1, 2, 4)))
    (seq,) = eng.generate([_prompts()[1]], GREEDY)
    assert seq.output_ids == generate(oracle, _prompts()[1], 32, temperature=0)
    assert eng.stats["accepted_tokens"] > 0.8 * eng.stats["draft_tokens"] > 0


def test_cancels_leave_no_trace(trained):
    """Requests cancelled at random steps, mid-speculation too: later requests' outputs are
    the target's, and no finished request's hidden states stay in the log."""
    eng = Engine(trained, ByteTokenizer(), EngineConfig(
        max_model_len=128, speculative="mtp", num_speculative_tokens=3, max_num_seqs=2))
    rng = random.Random(0)
    for i in range(30):
        rid = eng.add_request(_prompts(seed=i)[rng.randrange(3)], GREEDY)
        for _ in range(rng.randrange(1, 12)):
            eng.step()
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    assert eng.stats["draft_tokens"] > 0
    for prompt in _prompts():
        (seq,) = eng.generate([prompt], GREEDY)
        assert seq.output_ids == generate(trained, prompt, 32, temperature=0)
    assert all(eng.runner.hidden_log.span(s) == (0, 0) for s in range(2))


def test_saved_with_its_head(trained, tmp_path):
    model, _ = load_checkpoint(save_checkpoint(trained, tmp_path / "ckpt"))
    assert model.cfg.mtp_layers == 1
    a, b = trained.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.startswith("mtp.") for k in a)


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_prefilled_requests_speculate(oracle, method):
    """A decode worker's requests arrive prefilled elsewhere (``hyla serve --role decode
    --speculative ...``): their drafts start from what the worker computes (MTP: no hidden
    states for the prompt), and the output is still the target's."""
    eng = Engine(oracle, None, EngineConfig(max_model_len=128, speculative=method,
                                            num_speculative_tokens=3))
    for prompt in _prompts():
        want = generate(oracle, prompt, 32, temperature=0)
        state = oracle.new_state()
        first = int(oracle.prefill(torch.tensor(prompt), state)[-1].argmax())
        seq = eng.add_prefilled(prompt, first, state, GREEDY)
        while eng.has_unfinished():
            eng.step()
        assert seq.output_ids == want
    assert eng.stats["accepted_tokens"] > 0


def test_decode_worker_takes_the_speculative_flags(oracle):
    from hyla.disagg.live.worker.decode import build_decode_worker

    _, async_engine, rx = build_decode_worker(
        oracle, ByteTokenizer(), "m", EngineConfig(max_model_len=128, speculative="mtp"))
    try:
        assert async_engine.engine.speculator is not None
        assert async_engine.engine.runner.hidden_log is not None
    finally:
        rx.close()


def test_the_hidden_log_keeps_copies_and_trims_in_batches():
    """A decode step's rows are slices of its whole output (logits too): the log must not
    keep that alive (found: 346 MB held for 0.7 MB of rows), and it trims past 2 * keep
    rows, not on every row past keep (found: 28 ms a row at d = 2048)."""
    from hyla.serve.hidden_log import HiddenLog

    log = HiddenLog(keep=8)
    out = torch.randn(3, 32000 + 4)
    log.put(0, 0, out[:1, -4:])
    assert log.rows(0, 0, 1).untyped_storage().nbytes() == 4 * 4
    for p in range(1, 16):
        log.put(0, p, torch.full((1, 4), float(p)))
    assert log.span(0) == (0, 16)           # 2 * keep rows: all kept
    log.put(0, 16, torch.zeros(1, 4))       # one more: the last keep rows
    assert log.span(0) == (9, 17)
    assert log.rows(0, 9, 11)[:, 0].tolist() == [9.0, 10.0]


def test_the_mtp_state_grows_in_place(oracle):
    """One run, and runs of 1-5 pairs through a state that starts with room for 4 rows
    (doubling as it fills), give the same outputs."""
    from hyla.model.mtp import MTPState

    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h = oracle(ids[None], hidden=True)[0]
    whole = MTPState(oracle).run(ids[1:].tolist(), h[:-1])
    st, parts, at = MTPState(oracle, capacity=4), [], 0
    while at < 39:
        n = min(1 + at % 5, 39 - at)
        parts.append(st.run(ids[at + 1:at + 1 + n].tolist(), h[at:at + n]))
        at += n
    assert st.capacity >= 39 and torch.allclose(torch.cat(parts), whole, atol=1e-5)
    st.truncate(10)
    again = st.run(ids[11:20].tolist(), h[10:19])       # rows past 10 overwritten
    assert torch.allclose(again, whole[10:19], atol=1e-5)


def test_mtp_head_refusals(oracle):
    from hyla.model.quantize import quantize_model

    plain = HylaLM(preset("debug")).eval()
    with pytest.raises(ValueError, match="no MTP head to train"):
        mtp_distill_step(plain, torch.zeros(1, 8, dtype=torch.long), None)
    with pytest.raises(ValueError, match="no softmax-attention layer"):
        with_mtp_head(HylaLM(dataclasses.replace(preset("debug"), layers="GG")))
    quantize_model(plain, "int8")
    with pytest.raises(ValueError, match="quantised"):
        with_mtp_head(plain)


def test_an_export_without_room_for_the_head_says_so(oracle, tmp_path, capsys):
    """Llama's format has no place for an MTP head: the export says it leaves it out and
    counts the parameters it wrote (found: silently dropped, the count including it)."""
    from hyla.cli.main import main

    ckpt = save_checkpoint(oracle, tmp_path / "ckpt", ByteTokenizer())
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "multi-token-prediction head" in said and "left out" in said
    head = sum(p.numel() for p in oracle.mtp.parameters())
    assert f"{oracle.num_parameters() - head:,} parameters" in said


def test_the_cli_names_a_missing_head_first(tmp_path, capsys):
    """``--speculative mtp`` on a model without a head fails naming it, even with a
    temperature that would leave speculation unused (found: "not used" instead)."""
    from hyla.cli.main import main

    assert main(["generate", "--preset", "debug", "--prompt", "hi", "--max-tokens", "2",
                 "--speculative", "mtp"]) == 2
    assert "no multi-token-prediction layers" in capsys.readouterr().err


def test_generate_says_how_many_drafts_were_kept(tmp_path, capsys):
    from hyla.cli.main import main

    assert main(["generate", "--preset", "debug", "--prompt", "abcabcabcabc",
                 "--max-tokens", "24", "--temperature", "0", "--speculative", "ngram"]) == 0
    assert re.search(r"ngram drafts: \d+ of \d+ kept", capsys.readouterr().err)


def test_unsure_head_backs_off(trained):
    """A head never sure enough drafts nothing, then waits 1, 2 ... steps (its forward and
    lm_head each step would cost for nothing), and the ramp starts at one draft."""
    state = RunnerState(trained)
    unsure, plain = MTPDrafter(trained, 3, confidence=0.999), MTPDrafter(trained, 3)
    for d in (unsure, plain):
        d.attach(state.keep_hidden(), 0)
    tokens = _prompts(1)[0]
    state.prefill(tokens)
    assert unsure.draft(tokens + [7], room=8) == []
    assert unsure.waiting() and not unsure.waiting()
    assert len(plain.draft(tokens + [7], room=8)) == 1


def test_the_memory_line_counts_the_mtp_state(oracle):
    """A running request's MTP state (the target's hidden states it drafts from, the MTP
    layer's keys and values) is in ``hyla serve``'s memory line; a finished one's is gone."""
    from hyla.serve.memory_report import breakdown, describe

    eng = Engine(oracle, None, EngineConfig(max_model_len=128, speculative="mtp",
                                            num_speculative_tokens=3, max_num_seqs=2))
    eng.add_request(_prompts()[2], GREEDY)
    for _ in range(6):
        eng.step()
    parts = breakdown(eng)
    drafter = next(iter(eng.speculator._drafters.values()))
    d = oracle.cfg.d_model
    # the log's rows (40 prompt positions and more, d floats each) and the state's buffer
    assert parts["mtp_state"] >= 40 * d * 4 + drafter.state_bytes() > 40 * d * 4
    assert "+ MTP state" in describe(parts)
    from hyla.serve.metrics import EngineMetrics

    line = next(x for x in EngineMetrics().render(eng).decode().splitlines()
                if x.startswith('hyla_state_bytes{group="mtp"}'))
    assert float(line.split()[-1]) == parts["mtp_state"]
    while eng.has_unfinished():
        eng.step()
    assert breakdown(eng)["mtp_state"] == 0

"""Checks every layer kind must pass in the serving engine, shared by the mixers' tests:
greedy decoding equal to the model's own loop, prefix-cache snapshots that carry the whole
fixed state, and a prefill-only state that decodes elsewhere like a local one."""

import torch

from hyla.model import SequenceState
from hyla.model.generate import generate
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def check_engine_greedy_matches_model_loop(model, seed: int, **engine) -> None:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 3, 29, 50, 7)]
    want = [generate(model, p, 8, temperature=0) for p in prompts]
    eng = Engine(model, None, EngineConfig(max_model_len=96, **engine))
    assert [s.output_ids for s in eng.generate(prompts, GREEDY)] == want
    assert eng.scheduler.pool.num_used == 0


def check_prefix_cache_snapshots(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (70,), generator=g).tolist()
    tails = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 5, 8)]
    eng = Engine(model, None, EngineConfig(max_model_len=128, snapshot_interval=32))
    eng.generate([shared + tails[0]], GREEDY)
    seqs = eng.generate([shared + t for t in tails[1:]], GREEDY)
    assert all(s.num_cached_tokens == 64 for s in seqs)
    assert [s.output_ids for s in seqs] == [generate(model, shared + t, 8, temperature=0)
                                            for t in tails[1:]]


def check_prefill_only_hand_over(model, seed: int) -> None:
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    want = generate(model, prompt, 8, temperature=0)
    pre = Engine(model, None, EngineConfig(max_model_len=48, max_num_batched_tokens=16))
    pre.add_request(prompt, GREEDY, "p", prefill_only=True)
    outs = []
    while pre.has_unfinished():
        outs += pre.step()
    (o,) = outs
    shipped = SequenceState.unflatten(o.state.flatten())
    dec = Engine(model, None, EngineConfig(max_model_len=64))
    seq = dec.add_prefilled(prompt, o.token_ids[0], shipped, GREEDY)
    while dec.has_unfinished():
        dec.step()
    assert seq.output_ids == want

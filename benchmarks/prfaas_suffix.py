"""PrfaaS: a conversation's next turn ships only the state its decode worker has not cached.

Multi-turn chats through the live cluster's parts, in one process: a prefill worker's
``PrefillService`` prefills each turn's prompt and ships its state over the real transfer
channel (pyzmq on loopback, ``StateReceiver``) to a decode engine with its prefix cache on,
which decodes the answer (greedy, ``--answer`` tokens); the next turn's prompt repeats the
conversation so far and adds a user message. Each turn is sent remote, as the router sends
a long incremental prefill, to the worker that served the conversation before, and the
router's own index of that worker's KV blocks (``PrefixIndex`` in 16-token chunks, of the
prompts it routed there and their answers but the last token, as ``LiveRouter`` keeps it)
says how much of the prompt that worker holds: the state goes without those tokens'
attention rows (``SequenceState.suffix``). Reported: the bytes the transfers carried against the
bytes of whole states (the same transfers plus the rows left out), the decode worker's
loads after a cached prefix against misses, and whether the last turn's answers (the
longest prompts) equal a local prefill's on a fresh engine. (With quantised weights they
may part at a near-tie, as a local prefix-cache hit's do: a prefix's rows computed in
another chunk of prompt take another dense bf16 GEMM, which rounds differently; in float
they are equal.)

Conversations share a 96-token system prompt; messages take the shipped Azure conversation
trace's lengths scaled to 30-300 tokens, so prompts grow from ~130 to ~1,500 tokens.
``--model smollm2`` (default; SmolLM2-135M-Instruct as served, ``--quantize auto``: every
layer attention, so the state is all KV) or a hyla preset (``small``: GLA and attention).
``--quick``: 2 conversations, 3 turns.
"""

from __future__ import annotations

import asyncio

import torch

from benchmarks.serve_chat_cache import message_lengths
from benchmarks.serve_common import engine, greedy, hyla_model, random_prompts, served_smollm2
from hyla.disagg.live.transfer.net import StateReceiver
from hyla.disagg.live.worker.prefill import PrefillService
from hyla.disagg.policy.prefix_index import PrefixIndex, chunk_chain
from hyla.model.state import SequenceState


def add_args(p) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2, or a hyla preset such as "
                   "small (%(default)s)")
    p.add_argument("--conversations", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--turns", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--answer", type=int, default=32, help="tokens an answer (%(default)s)")
    p.add_argument("--quantize", default="auto", help="SmolLM2's scheme (%(default)s)")


def row_bytes(model) -> int:
    """Bytes of one token's rows of every growing state entry (attention keys and values)."""
    empty = SequenceState.empty(model.cfg)
    return sum(t[0].numel() * t.element_size() if len(t) else
               torch.Size(t.shape[1:]).numel() * t.element_size()
               for spec, ts in zip(model.state_specs, empty.tensors, strict=True)
               for t in ts[len(spec.fixed):])


def main(run) -> None:
    a = run.args
    torch.set_num_threads(a.threads or 1)
    convs, turns = (2, 3) if a.quick else (a.conversations, a.turns)
    if a.model == "smollm2":
        model, _, scheme, _ = served_smollm2(a.quantize)
    else:
        model, scheme = hyla_model(a.model), "none"
    vocab = model.cfg.vocab_size
    max_len = 4096
    svc = PrefillService(model, max_model_len=max_len)
    rx = StateReceiver(svc.fingerprint, svc.kinds)
    dec = engine(model, max_model_len=max_len, max_num_seqs=4)
    index = PrefixIndex(chunk_tokens=16, capacity=8192)        # LiveRouter's kv_index
    per_row = row_bytes(model)
    system = random_prompts([96], vocab, seed=1)[0]
    lengths = iter(message_lengths(convs * (turns + 1)))
    talks = [system + random_prompts([next(lengths)], vocab, seed=10 + c)[0]
             for c in range(convs)]
    rows, equal = [], True
    try:
        for turn in range(turns):
            for c in range(convs):
                prompt, rid = talks[c], f"c{c}t{turn}"
                chain = chunk_chain(prompt, index.chunk_tokens)
                held = index.match("decode-0", chain)
                r = svc.run_sync(rid, prompt, greedy(1), rx.address, prefix_tokens=held)
                tr = asyncio.run(rx.wait(rid, 60))
                seq = dec.add_prefilled(prompt, tr.first_token, tr.state, greedy(a.answer),
                                        rid)
                while dec.has_unfinished():
                    dec.step()
                index.insert("decode-0", chunk_chain(prompt + seq.output_ids[:-1], 16))
                if turn == turns - 1:       # the longest prompts, against a local prefill
                    (fresh,) = engine(model, max_model_len=max_len).generate(
                        [prompt], greedy(a.answer))
                    equal &= fresh.output_ids == seq.output_ids
                rows.append({"turn": turn, "conversation": c, "prompt_tokens": len(prompt),
                             "held_tokens": held, "shipped_bytes": r["bytes"],
                             "whole_bytes": r["bytes"] + held * per_row})
                talks[c] = prompt + seq.output_ids + random_prompts(
                    [next(lengths)], vocab, seed=100 * turn + c)[0]
            run.progress(f"turn {turn}: prompts {[len(t) for t in talks]}")
    finally:
        svc.close()
        rx.close()
    shipped = sum(x["shipped_bytes"] for x in rows)
    whole = sum(x["whole_bytes"] for x in rows)
    later = [x for x in rows if x["turn"] > 0]
    s = dec.scheduler
    summary = {"turns": len(rows), "shipped_MB": shipped / 1e6, "whole_MB": whole / 1e6,
               "shipped_share": shipped / whole,
               "later_turns_shipped_share": sum(x["shipped_bytes"] for x in later)
               / max(1, sum(x["whole_bytes"] for x in later)),
               "loads_after_cached_prefix": s.shipped_prefix_hits,
               "recomputed_for_eviction": s.shipped_prefix_misses,
               "last_answers_equal_local": equal}
    run.table(f"states shipped, {a.model} ({scheme}), {convs} conversations x {turns} turns",
              [summary])
    name = "prfaas_suffix" + (f"_{a.model}" if a.model != "smollm2" else "") + (
        "_fp32" if scheme == "none" and a.model == "smollm2" else "") + "_quick" * a.quick
    run.save(rows, name=name, model=a.model, scheme=scheme,
             totals=summary, summary=(
                 f"{a.model}: {summary['shipped_share']:.0%} of whole states' bytes shipped "
                 f"({summary['shipped_MB']:.1f} of {summary['whole_MB']:.1f} MB), later turns "
                 f"{summary['later_turns_shipped_share']:.0%}; {s.shipped_prefix_hits} loads "
                 f"after a cached prefix, {s.shipped_prefix_misses} recomputed; answers "
                 f"{'equal' if equal else 'DIFFERENT from'} local prefill's"))

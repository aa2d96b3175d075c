"""The prefix cache hits a multi-turn chat's turns near the ideal, answers included.

Conversations share a 96-token system prompt; each turn adds a user message (lengths from the
shipped Azure conversation trace, scaled to 30-300 tokens) and repeats the previous answer,
so prompts grow from ~100 to ~2,000 tokens. Conversations take turns round-robin, four at a
time in a 4-slot engine (``small`` hybrid GGGA x2 and GLA-only, random weights, greedy
answers of ``--answer`` tokens). The ideal hit of a request is the longest block-aligned
prefix it shares with what was computed before (its previous turn's prompt and answer, or
the system prompt); the table gives the hit tokens against it, the prefill saved, and a
cached turn's TTFT against the same prompt cold. ``--quick``: 4 conversations, 3 turns.
"""

from __future__ import annotations

import csv
import statistics
import time

import torch

from benchmarks.serve_common import engine, greedy, hyla_model, random_prompts
from hyla.disagg.sim.traces import trace_path

BLOCK = 16


def add_args(p) -> None:
    p.add_argument("--conversations", type=int, default=8, help="(default: %(default)s)")
    p.add_argument("--turns", type=int, default=5, help="(default: %(default)s)")
    p.add_argument("--answer", type=int, default=48, help="tokens an answer (%(default)s)")


def message_lengths(n: int) -> list[int]:
    """User message lengths: the Azure conversation trace's prompts, scaled to 30-300."""
    with open(trace_path("azure-conv"), encoding="utf-8") as f:
        raw = [int(r["num_prefill_tokens"]) for r in csv.DictReader(f)][:n]
    top = max(raw)
    return [30 + int(270 * x / top) for x in raw]


def run_chats(eng, vocab: int, convs: int, turns: int, answer: int) -> dict:
    system = random_prompts([96], vocab, seed=1)[0]
    lengths = iter(message_lengths(convs * (turns + 1)))
    prompts = [system + random_prompts([next(lengths)], vocab, seed=10 + c)[0]
               for c in range(convs)]
    computed: list[int | None] = [None] * convs      # tokens a conversation's last turn computed
    hit = ideal = total = 0
    seen_system = False
    for turn in range(turns):
        for c0 in range(0, convs, 4):       # four conversations at once
            group = list(range(c0, min(c0 + 4, convs)))
            seqs = eng.generate([prompts[c] for c in group], greedy(answer))
            for c, seq in zip(group, seqs, strict=True):
                n = len(prompts[c])
                shared = computed[c] if computed[c] is not None else (
                    len(system) if seen_system else 0)
                ideal += min(shared, n - 1) // BLOCK * BLOCK
                hit += seq.num_cached_tokens
                total += n
                computed[c] = n + len(seq.output_ids) - 1
                prompts[c] = prompts[c] + seq.output_ids + random_prompts(
                    [next(lengths)], vocab, seed=100 * turn + c)[0]
            seen_system = True
    return {"prompt_tokens": total, "hit_tokens": hit, "ideal_tokens": ideal,
            "of_ideal": hit / ideal if ideal else float("nan"), "prefill_saved": hit / total,
            "longest_prompt": max(len(p) for p in prompts)}


def ttft(eng, prompt: list[int]) -> float:
    t0, seq = time.perf_counter(), eng.add_request(prompt, greedy(1))
    while not seq.output_ids:
        eng.step()
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0


def main(run) -> None:
    a = run.args
    torch.set_num_threads(a.threads or 1)
    convs, turns = (4, 3) if a.quick else (a.conversations, a.turns)
    rows = []
    for name, layers in (("hybrid GGGA x2", None), ("GLA only", "GGGGGGGG")):
        run.progress(name)
        model = hyla_model("small", layers)
        eng = engine(model, max_num_seqs=4, max_model_len=4096, max_num_batched_tokens=2048)
        row = {"model": name, **run_chats(eng, model.cfg.vocab_size, convs, turns, a.answer)}
        # a cached 2K-token conversation against the same prompt in a fresh engine
        chat = random_prompts([2048], model.cfg.vocab_size, seed=5)[0]
        eng.generate([chat], greedy(a.answer))
        follow = chat + random_prompts([32], model.cfg.vocab_size, seed=6)[0]
        warm = statistics.median(ttft(eng, follow + [i]) for i in range(3))
        cold = statistics.median(ttft(engine(model, max_num_seqs=4, max_model_len=4096,
                                             max_num_batched_tokens=2048), follow + [i])
                                 for i in range(3))
        rows.append(row | {"ttft_2k_cold_ms": 1e3 * cold, "ttft_2k_warm_ms": 1e3 * warm,
                           "ttft_ratio": warm / cold})
    run.table(f"{convs} conversations x {turns} turns, answers of {a.answer} tokens", rows)
    run.save(rows, name="serve_chat_cache" + "_quick" * a.quick, conversations=convs,
             turns=turns, answer=a.answer, summary="; ".join(
                 f"{r['model']}: {r['of_ideal']:.0%} of the ideal hit tokens, "
                 f"{r['prefill_saved']:.0%} of prefill saved, a cached 2K-token chat's TTFT "
                 f"{r['ttft_ratio']:.2f}x cold" for r in rows))

"""What an eager quantised verify costs when its fixed-size states step through the drafts
one row at a time (``Context.chain``, exact: the state left is plain decoding's bitwise)
against the prefill chunk such models verified as before (the chunk form, which rounds
otherwise), and against one plain step.

Random-weight ``small``-width stacks of 12 layers (GLA + attention, gated delta +
attention, 3:1), ``--quantize`` (default int4), eager, one thread, a 200-token context:
a verify of 4 tokens (the last sampled token and 3 drafts), the state restored after each.
``--rounds`` alternating rounds of ``--repeats`` calls each, medians. ``--quick``: 1 round.
"""

import dataclasses
import statistics
import time

import torch

from hyla.model import Context, HylaLM, preset
from hyla.model.quantize import one_row_products, quantize_model
from hyla.serve.session import RunnerState

STACKS = {"GLA + attention": "GGGA" * 3, "gated delta + attention": "DDDA" * 3}


def add_args(p) -> None:
    p.add_argument("--quantize", default="int4", help="the scheme (%(default)s)")


def cases(model, repeats: int) -> dict:
    """The three calls on a 200-token context, each timed over ``repeats`` with the state
    restored after every call."""
    state = RunnerState(model)
    state.prefill(list(range(1, 201)))
    r, n = state.runner, state.num_tokens
    table, toks = state._table(n + 8), [5, 6, 7, 8]

    def restored(fn):
        def call():
            saved = r.save_scratch(0)
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
                r.restore_scratch(0, saved)
            return (time.perf_counter() - t0) / repeats
        return call

    def chunk():
        ctx = Context.prefill([n], [4], [0], [table], r.buffers, block_size=r.block_size,
                              pad_block=r.pad_block, device=r.device, last_logits=False)
        with one_row_products(True), torch.inference_mode():
            r._forward(torch.tensor(toks), ctx, [(0, toks, n, table)])

    return {"plain step": restored(lambda: r._decode([0], [5], [n], [table], 1, False)),
            "verify, chained": restored(lambda: r.verify(0, toks, n, table)),
            "verify, prefill chunk": restored(chunk)}


def main(run) -> None:
    a = run.args
    torch.set_num_threads(a.threads or 1)
    rows = []
    for name, layers in STACKS.items():
        torch.manual_seed(0)
        model = HylaLM(dataclasses.replace(preset("small"), layers=layers)).eval()
        quantize_model(model, a.quantize)
        med = {k: statistics.median(v) for k, v in run.rounds(
            cases(model, max(a.repeats, 5)), 1 if a.quick else None).items()}
        rows.append({"stack": name, "plain_ms": 1e3 * med["plain step"],
                     "chained_ms": 1e3 * med["verify, chained"],
                     "chunk_ms": 1e3 * med["verify, prefill chunk"],
                     "chained_vs_chunk": med["verify, chained"] / med["verify, prefill chunk"],
                     "chained_plain_steps": med["verify, chained"] / med["plain step"]})
    run.table(f"a 4-token verify, {a.quantize}, eager, one thread", rows)
    run.save(rows, scheme=a.quantize, summary="; ".join(
        f"{x['stack']}: chained {x['chained_ms']:.1f} ms, prefill chunk {x['chunk_ms']:.1f} "
        f"ms ({x['chained_vs_chunk']:.2f}x), {x['chained_plain_steps']:.2f} plain steps"
        for x in rows))

"""Grammar-constrained decoding costs little: SmolLM2's decode step with 16 concurrent
JSON-schema requests against the same 16 unconstrained, and the two grammar engines side
by side on the 30 test schemas.

Part 1 (the engine hyla uses, llguidance): SmolLM2-135M-Instruct as ``hyla serve`` runs it
(``--quantize auto``, eager), 16 requests at once, each decoding 48 greedy tokens;
constrained requests follow a closed schema with bounded strings (a title of at least 240
characters), so none finishes before its 48 tokens. Time a decode step, alternating plain
and constrained rounds; the overhead is the difference over the plain step (target <= 10%).

Part 2: for each of the 30 schemas (``benchmarks/data/json_schemas.py``), compile time and
the median time to compute one token's mask along the schema's example, for llguidance and
(when installed: ``pip install xgrammar``) XGrammar, on SmolLM2's 49,152-token vocabulary.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from benchmarks.data.json_schemas import SCHEMAS
from benchmarks.serve_common import engine, served_smollm2
from hyla.serve.sequence import GrammarSpec, SamplingParams

BOUNDED = {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 240, "maxLength": 260},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3,
             "maxItems": 3}}, "required": ["title", "tags"]}


def step_times(eng, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    """Wall time of each decode step while the batch decodes together."""
    seqs = [eng.add_request(p, params) for p in prompts]
    while any(not s.output_ids for s in seqs):
        eng.step()
    times = []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return times


def mask_costs(tok) -> list[dict]:
    from hyla.serve.json_schema import closed
    from hyla.serve.structured import GrammarCompiler

    vocab = 49152
    gc = GrammarCompiler(tok, vocab, [tok.eos_id])
    try:
        import xgrammar as xgr
        words = [""] * vocab
        for s, i in tok.backend.get_vocab(with_added_tokens=True).items():
            words[i] = s
        xc = xgr.GrammarCompiler(xgr.TokenizerInfo(words, xgr.VocabType.BYTE_LEVEL,
                                                   vocab_size=vocab, stop_token_ids=[tok.eos_id]),
                                 max_threads=1)
    except ImportError:
        xgr = xc = None
    rows = []
    for name, schema, example in SCHEMAS:
        ids = tok.encode(json.dumps(example)) + [tok.eos_id]
        row = {"schema": name, "tokens": len(ids)}
        t0 = time.perf_counter()
        m = gc.matcher(GrammarSpec("json_schema", json.dumps(schema)))
        row["llguidance_compile_ms"] = 1e3 * (time.perf_counter() - t0)
        mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        spent, ok = [], True
        for t in ids:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            spent.append(time.perf_counter() - t0)
            ok = ok and m.consume_token(t)
        row["llguidance_mask_us"] = 1e6 * statistics.median(spent)
        row["llguidance_ok"] = ok
        if xc is not None:
            t0 = time.perf_counter()
            cg = xc.compile_json_schema(json.dumps(closed(schema)), any_whitespace=False)
            row["xgrammar_compile_ms"] = 1e3 * (time.perf_counter() - t0)
            xm, bm = xgr.GrammarMatcher(cg), xgr.allocate_token_bitmask(1, vocab)
            spent, ok = [], True
            for t in ids:
                t0 = time.perf_counter()
                xm.fill_next_token_bitmask(bm, 0)
                spent.append(time.perf_counter() - t0)
                ok = ok and xm.accept_token(t)
            row["xgrammar_mask_us"] = 1e6 * statistics.median(spent)
            row["xgrammar_ok"] = ok
        rows.append(row)
    return rows


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    model, tok, scheme, _ = served_smollm2()
    n, tokens = (4, 16) if run.args.quick else (16, 48)
    msgs = [[{"role": "user", "content": f"Describe book number {i} as JSON: a title and "
                                          f"three tags."}] for i in range(n)]
    prompts = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True))
               for m in msgs]
    plain = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    bounded = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                             grammar=GrammarSpec("json_schema", json.dumps(BOUNDED)))
    eng = engine(model, tok, max_num_seqs=n, max_model_len=1024)
    step_times(eng, prompts, bounded)              # the compiler's tables, built once
    rounds = {"plain": [], "constrained": []}
    for r in range(run.args.rounds or 3):
        for name, params in (("plain", plain), ("constrained", bounded)):
            run.progress(f"round {r + 1}: {name}")
            rounds[name].append(statistics.median(step_times(eng, prompts, params)))
    base, con = statistics.median(rounds["plain"]), statistics.median(rounds["constrained"])
    step = [{"requests": n, "quantize": scheme, "plain_step_ms": 1e3 * base,
             "constrained_step_ms": 1e3 * con, "overhead": con / base - 1}]
    run.table(f"decode step, {n} concurrent requests (medians of rounds)", step)
    engines = mask_costs(tok)
    run.table("grammar engines on the 30 schemas", engines)
    worst = {k: max(r[k] for r in engines if k in r)
             for k in ("llguidance_compile_ms", "llguidance_mask_us", "xgrammar_compile_ms",
                       "xgrammar_mask_us") if any(k in r for r in engines)}
    run.save(step, engines=engines, worst=worst, summary=(
        f"{n} concurrent JSON-schema requests: decode step {1e3 * con:.1f} against "
        f"{1e3 * base:.1f} ms plain ({100 * (con / base - 1):+.1f}%, target <= 10%); over 30 "
        f"schemas llguidance compiles in <= {worst['llguidance_compile_ms']:.1f} ms and "
        f"masks a token in <= {worst['llguidance_mask_us']:.0f} us"
        + (f" (XGrammar {worst['xgrammar_compile_ms']:.1f} ms, "
           f"{worst['xgrammar_mask_us']:.0f} us)" if "xgrammar_mask_us" in worst else "")))

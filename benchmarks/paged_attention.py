"""In a compiled step, decode attention fused with the paged gather beats the op, to ~2K rows.

``attend_fused`` against ``hyla::paged_decode_attention``, SmolLM2-135M's shape (9 query heads,
3 KV heads of 64, bf16 cache, blocks of 16), 30 layers in one compiled function, one thread: ms,
16 sequences at 96 and 256 rows, one at 96 to 16,384. ``--quick``: 96 rows.
"""

import torch

from hyla.ops.paged_attention import attend_fused, paged_decode_attention

H, H_KV, D, BS, LAYERS = 9, 3, 64, 16, 30


def case(run, B: int, blocks: int) -> dict:
    g = torch.Generator().manual_seed(0)
    kv = [[torch.randn(B * blocks + 1, BS, H_KV, D, generator=g).bfloat16()
           for _ in range(LAYERS)] for _ in range(2)]
    args = (torch.randn(B, 1, H, D, generator=g), torch.arange(B * blocks).view(B, blocks),
            torch.full((B,), blocks * BS - 3))

    def layers(attend):     # q + each layer's attention, in turn
        return lambda q, tables, positions: sum(
            [attend(q, k, v, tables, positions) for k, v in zip(*kv, strict=True)], q)

    with torch.inference_mode():
        want, fns = layers(paged_decode_attention)(*args), {}
        for name, attend in {"op": paged_decode_attention, "fused": attend_fused}.items():
            torch._dynamo.mark_dynamic(args[1], 1)
            fns[name] = torch.compile(layers(attend), dynamic=False)
            run.progress(f"{B} x {blocks * BS} rows, {name}: compiled, max abs diff "
                         f"{(fns[name](*args) - want).abs().max().item():.2g}")
        ms = run.side_by_side({name: lambda fn=fn: 1e3 * run.median(lambda: fn(*args), repeats=15)
                               for name, fn in fns.items()})
    return {"batch": B, "rows": blocks * BS, **{f"{n}_ms": r["median"] for n, r in ms.items()},
            "fused_over_op": ms["fused"]["vs_base"]}


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    cases = ((16, 6), (1, 6)) if run.args.quick else ((16, 6), (16, 16), *((1, blocks)
                                                      for blocks in (6, 64, 256, 1024)))
    rows = [case(run, B, blocks) for B, blocks in cases]
    run.table(f"ms for {LAYERS} layers, compiled, one thread", rows)
    run.save(rows, summary="fused vs op, 30 layers: " + "; ".join(
        f"{r['batch']} x {r['rows']} rows {r['fused_ms']:.1f} vs {r['op_ms']:.1f} ms"
        for r in (rows[0], rows[-1])))

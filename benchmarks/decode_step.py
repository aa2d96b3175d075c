"""A GLA layer's per-token decode cost is flat in context; attention's grows with it.

B = 1, H = 8, K = V = 128, one thread: ``recurrent_gla`` on an fp32 state against SDPA over an
N + 1-token KV cache, the mixing op alone; samples of 20 steps interleaved over rounds, medians.
``--quick``: N = 1K and 4K, samples of 10.
"""

import torch
import torch.nn.functional as F

from hyla.ops.gla import recurrent_gla

B, H, D = 1, 8, 128


def steps(n: int, dtype: torch.dtype) -> dict:
    state = torch.zeros(B, H, D, D)  # fp32 whatever the input dtype, as the model keeps it
    q, k, v = torch.randn(3, B, 1, H, D).to(dtype)
    g = F.logsigmoid(torch.randn(B, 1, H, D)).div(16).to(dtype)
    kc, vc = torch.randn(2, B, H, n + 1, D).to(dtype)   # SDPA's layout: no copy
    sq, sk, sv = torch.randn(3, B, H, 1, D).to(dtype)
    return {"gla": lambda: recurrent_gla(q, k, v, g, initial_state=state, output_final_state=True),
            "attn_sdpa": lambda: (kc[:, :, n:].copy_(sk), vc[:, :, n:].copy_(sv),
                                  F.scaled_dot_product_attention(sq, kc, vc))}


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)    # B = 1: spinning workers cost ms a step
    inner, rows = 10 if run.args.quick else 20, []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1024, 4096) if run.args.quick else (1024, 2048, 4096, 8192, 16384, 32768):
            with torch.inference_mode():
                fns = steps(n, dtype)
                for fn in fns.values():
                    fn()    # warm-up
                t = run.side_by_side({name: lambda fn=fn: [fn() for _ in range(inner)] and None
                                      for name, fn in fns.items()})   # None: timed
            rows.append({"dtype": str(dtype)[6:], "context": n,
                         **{f"{k}_us": r["median"] / inner * 1e6 for k, r in t.items()},
                         "ratio_sdpa_over_gla": t["attn_sdpa"]["vs_base"],
                         "kv_cache_MB": 2 * B * H * n * D * dtype.itemsize / 1e6})
    run.table(f"decode step, one layer, B={B} H={H} K=V={D} (us a token)", rows)
    r = {(x["dtype"], x["context"]): x["ratio_sdpa_over_gla"] for x in rows}
    run.save(rows, inner=inner, gla_state_MB=B * H * D * D * 4 / 1e6, summary=f"SDPA's decode "
             f"step over GLA's, fp32: {r['float32', 1024]:.1f}x at 1K tokens, "
             f"{r['float32', n]:.0f}x at {n // 1024}K ({r['bfloat16', n]:.0f}x in bf16)")

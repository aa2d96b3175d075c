"""Over a long paged KV cache a decode query is faster as two GEMMs than SDPA, from ~2K rows.

``attend_one_query`` against SDPA on the rows' strided view, SmolLM2-135M's shapes, one thread:
ms for 30 layers' distinct caches per length and KV dtype. ``--quick``: 256 and 1,024 rows.
"""

import torch
import torch.nn.functional as F

from hyla.ops.attention import attend_one_query

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def case(run, n: int, dtype: torch.dtype) -> dict:
    caches = [(torch.randn(n, KV_HEADS, DIM).to(dtype), torch.randn(n, KV_HEADS, DIM).to(dtype))
              for _ in range(LAYERS)]
    q = torch.randn(HEADS, DIM).to(dtype)
    grouped = q.view(1, KV_HEADS, HEADS // KV_HEADS, DIM)
    sdpa = run.median(lambda: [F.scaled_dot_product_attention(
        grouped, k.transpose(0, 1)[None], v.transpose(0, 1)[None]) for k, v in caches])
    gemms = run.median(lambda: [attend_one_query(q, [k], [v]) for k, v in caches])
    return {"rows": n, "kv_dtype": str(dtype)[6:], "sdpa_ms": sdpa * 1e3,
            "gemms_ms": gemms * 1e3, "speedup": sdpa / gemms}


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    with torch.inference_mode():
        rows = [case(run, n, dtype)
                for n in ((256, 1024) if run.args.quick else (1024, 2048, 4096, 16384))
                for dtype in (torch.float32, torch.bfloat16)]
    run.table(f"one decode query over {LAYERS} layers' KV caches", rows)
    run.save(rows, summary="two GEMMs vs SDPA at {} rows: {:.2f}x fp32, {:.2f}x bf16".format(
        rows[-1]["rows"], rows[-2]["speedup"], rows[-1]["speedup"]))

"""KV throughput: Gbps of state/KV one prefill instance emits, dense vs hybrid models.

A prefill instance (8 x H200, roofline of :mod:`hyla.disagg.sim.hardware`) prefills
``tokens``-token prompts back to back; what it hands to decode per prompt is the attention
layers' KV for every token plus the linear layers' fixed state. Divided by the prefill
time, that is the egress rate the link must carry per busy prefill instance.

Rows: the 1T model of the published case study (our reconstruction) with every layer
attention (dense, with GQA and with MLA), one attention layer in four (3:1) and one in
eight (7:1, the published mix), on 8 x H200; and the same mixes of hyla's ``laplace-3b``
shape (GQA attention with 8 KV heads, bf16 KV, fp32 GLA state) on one H200, their bytes
from :mod:`hyla.eval.memory`.

Published figures (8 x H200, 32K tokens): dense models 33.35 (Qwen3-235B) to 59.93 Gbps
(MiniMax-M2.5), 8.25 Gbps for a 3:1 hybrid (Qwen3.5-397B), 3.19 Gbps for the paper's internal 1T 7:1
case-study model (its Table 5; Ring-2.5-1T, measured separately, is 2.59: Table 3). They are
other models than ours except the last, so only the ratios and the 1T row compare directly.
"""

from __future__ import annotations

import dataclasses

from hyla.disagg.sim.hardware import InstanceProfile, kv_gbps, published_1t_hybrid, step_time

MIXES = {"dense": "A", "3:1 hybrid": "GGGA", "7:1 hybrid": "GGGGGGGA"}
PUBLISHED_GBPS = {("1T", "dense (GQA)"): "33.35-59.93 (other dense models)",
                  ("1T", "dense (MLA)"): "33.35-59.93 (other dense models)",
                  ("1T", "3:1 hybrid"): "8.25 (Qwen3.5-397B)",
                  ("1T", "7:1 hybrid"): "3.19 (the paper's 1T case study)"}


def _hyla_spec(mix: str, pattern: str):
    from hyla.disagg.sim.hardware import spec_from_config
    from hyla.model.config import preset

    cfg = dataclasses.replace(preset("laplace-3b"), n_kv_heads=8)
    cfg = dataclasses.replace(cfg, layers=(pattern * 24)[:24])
    return spec_from_config(cfg, name=f"laplace-3b shape ({mix})")


def kv_table(tokens: int = 32_768, *, gpu: str = "H200", include_hyla: bool = True) -> list:
    """One row per (model, mix): bytes per request, prefill seconds, KV and KV+state Gbps.

    Example:
        >>> rows = kv_table(include_hyla=False)
        >>> [r["mix"] for r in rows]
        ['dense (GQA)', 'dense (MLA)', '3:1 hybrid', '7:1 hybrid']
        >>> rows[0]["kv_gbps"] > 10 * rows[3]["kv_gbps"]
        True
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    big, one = InstanceProfile(gpu=gpu), InstanceProfile(gpu=gpu, gpus=1)
    specs = [("1T", "dense (GQA)", published_1t_hybrid("A" * 80, attention="gqa"), big)]
    specs += [("1T", mix.replace("dense", "dense (MLA)"), published_1t_hybrid((pat * 80)[:80]),
               big) for mix, pat in MIXES.items()]
    if include_hyla:
        specs += [("laplace-3b", mix.replace("dense", "dense (GQA)"), _hyla_spec(mix, pat), one)
                  for mix, pat in MIXES.items()]
    rows = []
    for family, mix, spec, prof in specs:
        rows.append({
            "model": f"{family} {spec.layers.count('A')}A/{len(spec.layers)}",
            "family": family, "mix": mix, "tokens": tokens,
            "kv_bytes": spec.kv_bytes_per_token * tokens, "state_bytes": spec.state_bytes,
            "transfer_bytes": spec.transfer_bytes(tokens),
            "prefill_s": step_time(prof, spec, [(0, tokens)], 0),
            "kv_gbps": kv_gbps(prof, spec, tokens, include_state=False),
            "total_gbps": kv_gbps(prof, spec, tokens),
            "published_gbps": PUBLISHED_GBPS.get((family, mix)),
            "instance": prof.label(),
        })
    for fam in {r["family"] for r in rows}:
        dense = next(r for r in rows if r["family"] == fam and r["mix"].startswith("dense"))
        for r in rows:
            if r["family"] == fam:
                r["reduction_vs_dense"] = dense["total_gbps"] / r["total_gbps"]
    return rows

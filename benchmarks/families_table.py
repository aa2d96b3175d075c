"""The shipped hybrid families at full size emit 2-3.3x less state a sequence than dense twins.

Computed from each full-size config alone (``hyla.model.sizing``, no weights): total and
active parameters; state a sequence at 8K / 32K / 128K (bf16 caches, fp32 recurrent states,
a window layer's last ``window`` tokens only); KV throughput, those bytes over the prefill
time on the roofline of ``hyla.disagg.sim.hardware`` (one 8 x H200 instance at ``--mfu``,
2 ms a step); the same for a dense twin (every layer the model's own full attention, FFNs
unchanged, active parameters set equal); and the PrfaaS paper's measured KV throughput at
32K (arXiv:2604.15039, Table 3, read from public notes on it) with the MFU that gives it here.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter

import torch

from hyla.disagg.sim.hardware import InstanceProfile, kv_gbps, spec_from_config, step_time
from hyla.eval.memory import all_attention
from hyla.model import sizing

# Ring-2.5-1T is not transformers' BailingHybridConfig default (that is Ling-3.0-Flash).
# Published (model card, PrfaaS Table 1): 1T total, 63B active, 80 layers, 10 MLA + 70
# linear, 256 routed experts top-8 + 1 shared, KV ~11.2 KiB a token. MLA dims and expert
# groups: the Bailing-V2.5 configs. Assumed, from Ling-1T: hidden 8192, 64 heads of 128,
# expert width 2048, dense FFN 18432, vocabulary 157,184; first_k_dense_replace=4 lands the
# total on 1T (1 gives 1.05T). Its linear layers are Lightning attention; transformers' KDA
# has the same state plus short-conv windows and a full-rank forget-gate projection, which
# puts this config's active count ~5B (70 x 67M) above the published 63B.
RING_25_1T = dict(hidden_size=8192, num_hidden_layers=80, layer_group_size=8,
                  num_attention_heads=64, num_key_value_heads=64, head_dim=128,
                  intermediate_size=18432, moe_intermediate_size=2048, num_experts=256,
                  num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
                  first_k_dense_replace=4, q_lora_rank=1536, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  vocab_size=157184, routed_scaling_factor=2.5)
# name: transformers config class, its kwargs, published (total, active) parameters and KV
# throughput at 32K (Gbps, PrfaaS Table 3); sizes: the class's defaults (the model's own)
MODELS = {"Qwen3-Next-80B-A3B": ("Qwen3NextConfig", {}, (80e9, 3e9), None),
          "Kimi-Linear-48B-A3B": ("KimiLinearConfig", {}, (48e9, 3e9), 3.87),
          "MiMo-V2-Flash": ("MiMoV2FlashConfig", {}, (309e9, 15e9), 4.66),
          "Ring-2.5-1T": ("BailingHybridConfig", RING_25_1T, (1e12, 63e9), 2.59)}
PUBLISHED = {   # PrfaaS (Qin et al., arXiv:2604.15039): 8 x H200, SGLang v0.5.9
    "gbps_32k": {"Kimi Linear (48B)": 3.87, "MiMo-V2-Flash": 4.66, "Ring-2.5-1T": 2.59,
                 "Qwen3.5-397B (GDN + GQA 3:1, Qwen3-Next's layer pattern, another model)":
                 8.25, "MiniMax-M2.5 (dense GQA)": 59.93, "Qwen3-235B (dense GQA)": 33.35},
    "ring_2.5_1t_gbps": {"1K": 7.27, "32K": 2.59, "128K": 1.46},
    "internal_1t_hybrid_table5": {"state_mib": {"1K": 190.8, "8K": 308.9, "32K": 701.3,
                                                "128K": 2316.3},
                                  "gbps": {"1K": 3.61, "8K": 3.59, "32K": 3.19, "128K": 2.62}}}


def add_args(parser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--mfu", type=float, default=0.45, help="prefill MFU (default 0.45)")


def measure(cfg, tokens: list[int], prof, like: dict | None = None) -> dict:
    """Parameters, bounded state and KV throughput of ``cfg`` at each of ``tokens``; with
    ``like`` (another :func:`measure`), its active parameters are made that one's."""
    from hyla.model.mixers import MIXERS

    counts = own = sizing.parameter_counts(cfg)
    spec = spec_from_config(cfg)
    if like is not None:
        counts = own | {"active": like["active_params"],
                        "matmul_active": like["matmul_active_params"]}
        spec = dataclasses.replace(spec, active_params=counts["matmul_active"])
    kinds = Counter(MIXERS[c].kind + (" (window)" if w else "")
                    for c, w in zip(cfg.layers, sizing.layer_windows(cfg), strict=True))
    return {"layers": " + ".join(f"{n} {k}" for k, n in kinds.items()),
            "total_params": counts["total"], "active_params": counts["active"],
            "matmul_active_params": counts["matmul_active"], "own_active_params": own["active"],
            "by_context": {t: {
                "state_bytes": sizing.bounded_state_bytes(cfg, t, torch.bfloat16),
                "held_by_hyla_bytes": sum(s.nbytes(t, torch.bfloat16)
                                          for s in sizing.layer_specs(cfg)),
                "transfer_bytes": spec.transfer_bytes(t),
                "prefill_s": step_time(prof, spec, [(0, t)], 0),
                "prefill_flops": sizing.prefill_flops(cfg, t, counts)["total"],
                "kv_gbps": kv_gbps(prof, spec, t)} for t in tokens}}


def main(run) -> None:
    import transformers

    tokens, mfu = run.args.tokens, run.args.mfu
    prof, ref = InstanceProfile(gpu="H200", gpus=8, mfu=mfu), 32768 if 32768 in tokens \
        else tokens[-1]
    k, rows, models, missing = ref // 1024, [], [], []
    for name, (cls, kwargs, published, pub_gbps) in MODELS.items():
        try:
            cfg = sizing.config_from_dict(getattr(transformers, cls)(**kwargs).to_dict(),
                                          f"transformers.{cls}({', '.join(kwargs)})")
        except ValueError as e:       # a family not (yet) registered, or refusing a field
            missing.append({"model": name, "error": str(e)})
            print(f"skipped {name}: {e}", file=sys.stderr)
            continue
        hybrid = measure(cfg, tokens, prof)
        dense = measure(all_attention(cfg), tokens, prof, like=hybrid)
        at, dat, implied = hybrid["by_context"][ref], dense["by_context"][ref], None
        if pub_gbps is not None:    # the MFU at which this roofline's prefill gives it
            implied = at["prefill_flops"] * pub_gbps * 1e9 / (
                prof.gpus * prof.spec.tflops * 1e12 * at["transfer_bytes"] * 8)
        models.append({"model": name, "family": cfg.family, "transformers_config": cls,
                       "explicit_fields": kwargs, "published_params": published,
                       "hybrid": hybrid, "dense": dense, "published_gbps_32k": pub_gbps,
                       "implied_mfu": implied})
        rows.append({"model": name, "params B": hybrid["total_params"] / 1e9,
                     "active B": hybrid["active_params"] / 1e9,
                     **{f"state {t // 1024}K MB": hybrid["by_context"][t]["state_bytes"] / 1e6
                        for t in tokens},
                     f"prefill {k}K s": at["prefill_s"], f"KV Gbps {k}K": at["kv_gbps"],
                     f"dense {k}K MB": dat["state_bytes"] / 1e6, f"dense Gbps {k}K":
                     dat["kv_gbps"], "published Gbps": pub_gbps or "-", "implied MFU":
                     implied or "-"})
    run.table(f"Hybrid families at full size ({prof.label()}, {mfu:.0%} MFU roofline)", rows)
    run.save(rows, models=models, missing=missing, published=PUBLISHED, tokens=tokens,
             hardware={"instance": prof.label(), "gpu_tflops_bf16": prof.spec.tflops,
                       "mfu": mfu, "hbm_tb_s": prof.spec.hbm_tb_s, "mbu": prof.mbu,
                       "step_overhead_s": prof.step_overhead_s},
             summary=f"state a sequence at {k}K / KV Gbps (dense twin): " + ", ".join(
                 f"{r['model']} {r[f'state {k}K MB']:.0f} MB / {r[f'KV Gbps {k}K']:.3g} "
                 f"({r[f'dense {k}K MB']:.0f} MB / {r[f'dense Gbps {k}K']:.3g})" for r in rows),
             note="KV Gbps = state bytes * 8 / roofline prefill time")

"""The hybrid families at full size: parameters, state a sequence, KV throughput vs dense.

For each full-size config (transformers' defaults, or the published model's fields where the
default is another model), sized from the config alone through hyla's family readers
(``hyla.model.sizing``, no weights), per model:

- total and active parameters a token (a mixture of experts counts its router, top-k routed
  and shared experts; embeddings and the output head included, as model cards count them);
- state a sequence at 8K / 32K / 128K tokens from the layers' StateSpecs: bf16 caches
  (attention KV, MLA's compressed latent, short-conv windows), fp32 recurrent states, and a
  sliding-window layer's last ``window`` tokens only (what transformers' caches keep and a
  prefill hands over; hyla's engine pages every token of a window layer today);
- KV throughput: those bytes over the prefill time of that context, on the roofline of
  ``hyla.disagg.sim.hardware`` (one 8 x H200 instance, 989 TFLOP/s bf16 a GPU at 45% MFU,
  plus 2 ms a step). Prefill FLOPs are ``2 * N * T`` for the ``N`` active block parameters
  (no embedding lookup, the output head for the last token only) plus the attention layers'
  (query, key) pairs (a window layer's ``window`` a token) and the linear layers' state work;
- the same for a dense model of equal active size: every layer the model's own
  full-attention layer (MLA for Kimi Linear and Ring-2.5, GQA for Qwen3-Next and MiMo), the
  FFNs unchanged (same width, depth and experts), its active block parameters set equal to
  the hybrid's (built so, it has a few percent fewer for Qwen3-Next, Kimi and MiMo, whose
  linear or window layers are the larger, and 30% fewer for Ring-2.5, whose KDA layers are
  3.6x its MLA layers: its own count is in the JSON as ``own_active_params``);
- the PrfaaS paper's published KV throughput at 32K (arXiv:2604.15039, Table 3: 8 x H200,
  SGLang v0.5.9), and the MFU at which this roofline would give it.

    python benchmarks/families_table.py [--tokens 8192 32768 131072] [--mfu 0.45]

Prints a table (and, with --markdown, the README's table), writes
benchmarks/results/families_table.json.
"""

from __future__ import annotations

import argparse
import sys

from hyla.disagg.sim.hardware import InstanceProfile, kv_gbps, spec_from_config, step_time
from hyla.eval.memory import all_attention
from hyla.model import sizing
from hyla.perf import print_table, write_results

# Ring-2.5-1T is not what transformers' BailingHybridConfig defaults to (those are
# inclusionAI/Ling-3.0-Flash's, the checkpoint its docstring names), so its fields are given.
# Published (model card and PrfaaS Table 1): 1T total, 63B active, 80 layers, one MLA layer in
# eight (10 MLA + 70 linear), 256 routed experts top-8 + 1 shared, KV ~11.2 KiB a token
# (= 10 layers x (512 + 64) bf16). MLA dims and expert groups: the Bailing-V2.5 configs
# (tiny-random/ring-2.5's and Ling-2.6-flash's config.json). Assumed, from Ling-1T (the
# Ling 2.0 1T model it descends from): hidden 8192, 64 heads of 128, expert width 2048, dense
# FFN 18432, vocabulary 157,184; first_k_dense_replace=4 because it lands the total on the
# published 1T (1 gives 1.05T). Its linear layers are Lightning attention (64 heads x 128 x
# 128 fp32 state, no short conv) where transformers' bailing_hybrid has KDA: the same state
# plus short-conv windows, and a full-rank forget-gate projection (8192 x 8192 a layer) that
# Lightning lacks, which puts this config's active count ~5B (70 x 67M) above the published
# 63B.
RING_25_1T = dict(hidden_size=8192, num_hidden_layers=80, layer_group_size=8,
                  num_attention_heads=64, num_key_value_heads=64, head_dim=128,
                  intermediate_size=18432, moe_intermediate_size=2048, num_experts=256,
                  num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
                  first_k_dense_replace=4, q_lora_rank=1536, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  vocab_size=157184, routed_scaling_factor=2.5)

# name, transformers config class, its kwargs, where the sizes come from, published
# (total, active) parameters, published KV throughput at 32K (Gbps, PrfaaS Table 3).
MODELS = [
    ("Qwen3-Next-80B-A3B", "Qwen3NextConfig", {}, "transformers default "
     "(Qwen/Qwen3-Next-80B-A3B-Instruct's sizes)", (80e9, 3e9), None),
    ("Kimi-Linear-48B-A3B", "KimiLinearConfig", {}, "transformers default "
     "(moonshotai/Kimi-Linear-48B-A3B-Instruct's sizes)", (48e9, 3e9), 3.87),
    ("MiMo-V2-Flash", "MiMoV2FlashConfig", {}, "transformers default "
     "(XiaomiMiMo/MiMo-V2-Flash's sizes)", (309e9, 15e9), 4.66),
    ("Ring-2.5-1T", "BailingHybridConfig", RING_25_1T, "explicit fields (RING_25_1T: "
     "published + assumed, see the docstring)", (1e12, 63e9), 2.59),
]
PUBLISHED = {
    "source": "Prefill-as-a-Service (Qin et al., arXiv:2604.15039), Table 3: KV throughput "
              "at 32K tokens, one 8 x H200 instance, SGLang v0.5.9; read from public notes "
              "on the paper, not the PDF",
    "gbps_32k": {"Kimi Linear (48B)": 3.87, "MiMo-V2-Flash": 4.66, "Ring-2.5-1T": 2.59,
                 "Qwen3.5-397B (GDN + GQA 3:1, Qwen3-Next's layer pattern, another model)":
                 8.25, "MiniMax-M2.5 (dense GQA)": 59.93, "Qwen3-235B (dense GQA)": 33.35},
    "ring_2.5_1t_gbps": {"1K": 7.27, "32K": 2.59, "128K": 1.46},
    "internal_1t_hybrid_table5": {"note": "the case study's model, in-house vLLM",
                                  "state_mib": {"1K": 190.8, "8K": 308.9, "32K": 701.3,
                                                "128K": 2316.3},
                                  "gbps": {"1K": 3.61, "8K": 3.59, "32K": 3.19, "128K": 2.62}},
}


def _config(cls_name: str, kwargs: dict):
    import transformers

    hf = getattr(transformers, cls_name)(**kwargs).to_dict()
    return hf, sizing.config_from_dict(hf, f"transformers.{cls_name}({', '.join(kwargs)})")


def _mix(cfg) -> str:
    from collections import Counter

    from hyla.model.mixers import MIXERS

    windows = sizing.layer_windows(cfg)
    kinds = Counter(MIXERS[c].kind + (" (window)" if w else "")
                    for c, w in zip(cfg.layers, windows, strict=True))
    return " + ".join(f"{n} {k}" for k, n in kinds.items())


def measure(cfg, tokens: list[int], prof: InstanceProfile, like: dict | None = None) -> dict:
    """Parameters, bounded state and KV throughput of ``cfg`` at each of ``tokens``; with
    ``like`` (another model's :func:`measure`), its active parameters are made that one's."""
    import dataclasses

    import torch

    counts = own = sizing.parameter_counts(cfg)
    spec = spec_from_config(cfg)
    if like is not None:
        counts = {**own, "active": like["active_params"],
                  "matmul_active": like["matmul_active_params"]}
        spec = dataclasses.replace(spec, active_params=counts["matmul_active"])
    out = {"layers": _mix(cfg), "total_params": counts["total"],
           "active_params": counts["active"], "matmul_active_params": counts["matmul_active"],
           "own_active_params": own["active"], "by_context": {}}
    for t in tokens:
        state = sizing.bounded_state_bytes(cfg, t, torch.bfloat16)
        held = sum(s.nbytes(t, torch.bfloat16) for s in sizing.layer_specs(cfg))
        seconds = step_time(prof, spec, [(0, t)], 0)
        flops = sizing.prefill_flops(cfg, t, counts)["total"]
        out["by_context"][t] = {"state_bytes": state, "held_by_hyla_bytes": held,
                                "transfer_bytes": spec.transfer_bytes(t),
                                "prefill_s": seconds, "prefill_flops": flops,
                                "kv_gbps": kv_gbps(prof, spec, t)}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--mfu", type=float, default=0.45, help="prefill MFU (default 0.45)")
    ap.add_argument("--gpus", type=int, default=8, help="H200s an instance (default 8)")
    ap.add_argument("--markdown", action="store_true", help="also print the README table")
    args = ap.parse_args(argv)
    prof = InstanceProfile(gpu="H200", gpus=args.gpus, mfu=args.mfu)
    ref = 32768 if 32768 in args.tokens else args.tokens[-1]
    rows, models, missing = [], [], []
    for name, cls, kwargs, source, (pub_total, pub_active), pub_gbps in MODELS:
        try:
            hf, cfg = _config(cls, kwargs)
        except ValueError as e:       # a family not (yet) registered, or refusing a field
            missing.append({"model": name, "error": str(e)})
            print(f"skipped {name}: {e}", file=sys.stderr)
            continue
        hybrid = measure(cfg, args.tokens, prof)
        dense = measure(all_attention(cfg), args.tokens, prof, like=hybrid)
        at, dat = hybrid["by_context"][ref], dense["by_context"][ref]
        implied = None
        if pub_gbps is not None:    # the MFU at which this roofline's prefill gives it
            seconds = at["transfer_bytes"] * 8 / (pub_gbps * 1e9)
            implied = at["prefill_flops"] / (prof.gpus * prof.spec.tflops * 1e12 * seconds)
        models.append({"model": name, "family": cfg.family, "config": source,
                       "transformers_config": cls, "explicit_fields": kwargs,
                       "published_params": {"total": pub_total, "active": pub_active},
                       "hybrid": hybrid, "dense": dense, "published_gbps_32k": pub_gbps,
                       "implied_mfu": implied})
        row = {"model": name, "params B": hybrid["total_params"] / 1e9,
               "active B": hybrid["active_params"] / 1e9}
        for t in args.tokens:
            row[f"state {t // 1024}K MB"] = hybrid["by_context"][t]["state_bytes"] / 1e6
        row |= {f"prefill {ref // 1024}K s": at["prefill_s"],
                f"KV Gbps {ref // 1024}K": at["kv_gbps"],
                f"dense {ref // 1024}K MB": dat["state_bytes"] / 1e6,
                f"dense Gbps {ref // 1024}K": dat["kv_gbps"],
                "published Gbps": pub_gbps if pub_gbps is not None else "-",
                "implied MFU": implied if implied is not None else "-"}
        rows.append(row)
    print_table(f"Hybrid families at full size: state a sequence and KV throughput "
                f"({prof.label()}, {args.mfu:.0%} MFU roofline)", rows)
    if args.markdown:
        print(markdown(rows))
    path = write_results("families_table", rows, models=models, missing=missing,
                         published=PUBLISHED, tokens=args.tokens,
                         hardware={"instance": prof.label(), "gpu_tflops_bf16": prof.spec.tflops,
                                   "mfu": args.mfu, "hbm_tb_s": prof.spec.hbm_tb_s,
                                   "mbu": prof.mbu, "step_overhead_s": prof.step_overhead_s},
                         note="state: bf16 caches, fp32 recurrent states, window layers keep "
                              "their window; KV Gbps = state bytes * 8 / roofline prefill "
                              "time; dense = every layer the model's full attention, same "
                              "FFNs, active parameters set equal to the hybrid's")
    print(f"wrote {path}")


def markdown(rows: list[dict]) -> str:
    """The rows as a GitHub markdown table (numbers rounded for reading)."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"
        return str(v)
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

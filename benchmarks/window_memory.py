"""Window layers pay for their window only: MiMo-V2-Flash's state a sequence as the engine
allocates it, against window-bounded arithmetic and against paging every token.

Part 1 builds the serving runner for MiMo-V2-Flash's shipped config
(``examples/configs/mimo-v2-flash.json``: 48 layers, 39 of them with a 128-token window)
on the meta device, so nothing is allocated, and reads the bytes its buffers take for one
sequence at each context: the full-attention layers' KV blocks plus the slot's window rings
(bf16). "Window-bounded" is the arithmetic the issue names
(:func:`hyla.model.sizing.bounded_state_bytes`); "every token paged" is what the engine
held before window layers kept rings (their KV in blocks like a full layer's).

Part 2 serves a MiMo-shaped model small enough for a CPU (random weights, 2 full and 4
window layers) at growing prompt lengths and reads, after the prompt, the state the engine
holds by group (:func:`hyla.serve.memory_report.group_bytes`): the window group stays flat.
"""

from __future__ import annotations

import torch

from benchmarks.serve_common import ROOT, engine, greedy, random_prompts
from hyla.model import HylaConfig, HylaLM
from hyla.model.sizing import bounded_state_bytes, meta_model, read_config
from hyla.serve.memory_report import group_bytes
from hyla.serve.runner import Runner

MIB = 1 << 20
CONFIG = ROOT / "examples" / "configs" / "mimo-v2-flash.json"


def runner_bytes_a_sequence(model, context: int, block_size: int = 16) -> int:
    """What the runner's buffers hold for one sequence at ``context`` tokens: one slot of
    fixed entries and ``ceil(context / block_size)`` blocks (the pad slot and pad block
    left out)."""
    blocks = -(-context // block_size)
    runner = Runner(model, max_num_seqs=1, num_kv_blocks=blocks, block_size=block_size)
    total = 0
    for spec, layer in zip(runner.specs, runner.buffers, strict=True):
        total += sum(layer[e.name].nbytes // 2 for e in spec.fixed)
        total += sum(layer[e.name].nbytes * blocks // (blocks + 1) for e in spec.per_token)
    return total


def every_token_paged(cfg, context: int) -> int:
    """The state when window layers page every token as full ones do (before rings)."""
    total = 0
    for spec in meta_model(cfg).state_specs:
        row = spec.fixed_bytes(torch.bfloat16) // spec.window if spec.window else 0
        total += spec.fixed_bytes(torch.bfloat16) * (not spec.window) + context * (
            row + spec.per_token_bytes(torch.bfloat16))
    return total


def small_mimo() -> HylaLM:
    window = {"sliding_window": 128, "n_kv_heads": 4, "rope_theta": 1e4}
    cfg = HylaConfig(vocab_size=512, d_model=128, layers="AAAAAA", n_heads=8, n_kv_heads=2,
                     ffn_dim=256, attention_head_dim=32,
                     mixer_options={"attention": {"sinks": True, "value_head_dim": 16}},
                     layer_overrides=[{}, window, window, {}, window, window])
    torch.manual_seed(0)
    return HylaLM(cfg).eval()


def main(run) -> None:
    torch.set_num_threads(run.args.threads or 1)
    cfg = read_config(CONFIG)
    model = meta_model(cfg).to(torch.bfloat16)
    rows = []
    for context in (8192, 32768, 131072):
        run.progress(f"MiMo-V2-Flash at {context} tokens")
        held = runner_bytes_a_sequence(model, context)
        bound = bounded_state_bytes(cfg, context)
        rows.append({"context": context, "engine_MiB": held / MIB,
                     "window_bounded_MiB": bound / MIB, "vs_bounded": held / bound,
                     "every_token_paged_MiB": every_token_paged(cfg, context) / MIB})
    run.table("MiMo-V2-Flash: state a sequence (bf16)", rows)

    small = small_mimo()
    lengths = (256, 1024) if run.args.quick else (256, 1024, 4096)
    served = []
    for n in lengths:
        run.progress(f"small MiMo-shaped model, a {n}-token prompt")
        eng = engine(small, max_num_seqs=1, max_model_len=4200, max_num_batched_tokens=1024)
        seq = eng.add_request(random_prompts([n], 512, seed=n)[0], greedy(4))
        while not seq.output_ids:
            eng.step()
        held = group_bytes(eng)
        served.append({"prompt": n, **{f"{g}_KiB": v["in_use"] / 1024
                                       for g, v in held.items()}})
        while eng.has_unfinished():
            eng.step()
    run.table("small MiMo-shaped model served: state held after the prompt, by group",
              served)
    at8k = rows[0]
    run.save(rows, served=served, config=str(CONFIG.relative_to(ROOT)), summary=(
        f"MiMo-V2-Flash at 8K: the engine holds {at8k['engine_MiB']:.1f} MiB a sequence, "
        f"{at8k['vs_bounded']:.3f}x window-bounded arithmetic "
        f"({at8k['window_bounded_MiB']:.1f} MiB; {at8k['every_token_paged_MiB']:,.0f} MiB "
        f"when every token was paged); served at {lengths[0]}-{lengths[-1]} tokens the "
        f"window group holds {served[0]['window_KiB']:.0f} KiB throughout"))


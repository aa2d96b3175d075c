"""``hyla distill`` and ``hyla export``: thin maps onto hyla.train.distill and
hyla.model.formats.hf / hyla.model.formats.fla.

Example:
    $ hyla export --format llama runs/teacher runs/teacher-hf
    $ hyla export --format fla runs/student runs/student-fla
    $ hyla distill --teacher smollm2 --out runs/student         # the window-gla recipe
    $ hyla distill --teacher runs/teacher-hf --layers GGGAGGGA --out runs/student
    $ hyla distill --resume runs/student
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

from rich.console import Console

from hyla.cli.common import SOURCE_HELP, finished_line, refuse_existing_run
from hyla.train.config import OPTIMIZERS
from hyla.train.distill.config import LAYER_RANKINGS, DistillConfig
from hyla.train.distill.recipes import DEFAULT_RECIPE, RECIPE_FIELDS, RECIPES

_NONE_DEFAULT_TYPES = {"student_kv_heads": int, "stage1_seq_len": int, "data": str,
                       "eval_data": str, "report_tokens": int, "report_trials": int,
                       "report_tasks": str, "include_path": str, "lr": float,
                       **{f: int for f in RECIPE_FIELDS if f != "lr"}}
_CHOICES = {"optimizer": OPTIMIZERS, "recipe": tuple(RECIPES), "layer_ranking": LAYER_RANKINGS}
_HELP = {
    "teacher": "an all-attention model: " + SOURCE_HELP,
    "recipe": "what the student is and how it trains; each flag below overrides one part: "
              + "; ".join(f"{r.name}: {r.summary}" for r in RECIPES.values())
              + " (default: %(default)s)",
    "layers": "the student's layer mix: auto (auto:N with N a quarter of the teacher's "
              "layers), auto:N (the teacher keeps the N attention layers it ranks highest, "
              "the rest the recipe's linear letter), linear (every layer the recipe's linear "
              "letter), or a pattern of one mixer letter (G, A, D, K) per teacher layer "
              "(default: %(default)s)",
    "layer_ranking": "how --layers auto ranks the teacher's layers: probes (induction + "
                     "reach) or kl (the vocabulary KL each restored attention layer removes) "
                     "(default: %(default)s)",
    "student_kv_heads": "KV heads of the student's A layers, dividing the teacher's "
                        "(default: the teacher's)",
    "stage1_steps": "attention-transfer steps (teacher frozen, layer by layer)",
    "stage2_steps": "end-to-end steps (vocabulary KL + cross-entropy)",
    "seq_len": "tokens a block in stage 2 (and validation)",
    "stage1_seq_len": "tokens a block in stage 1 (default: --seq-len)",
    "out": "run directory (checkpoints, metrics.jsonl, report.json)",
    "window": "the student's linear layers as linearised attention: exact softmax over the "
              "last WINDOW tokens (and the first --sinks) beside the recurrent branch; 0: "
              "plain linear layers",
    "sinks": "with --window: first tokens of each document every query also sees",
    "lora_rank": "stage 2: LoRA of this rank on the mixers' q/k/v/o (0: full tuning)",
    "lora_alpha": "stage 2: LoRA scale numerator (the update is alpha / rank * B A)",
    "eval_every": "also print held-out perplexity every this many steps (0: at each stage's "
                  "end)",
    "autocast": "bf16 autocast: auto (where bf16 matmuls are fast), bf16 or off",
    "report_tokens": "held-out tokens a perplexity of report.json, 0: no report (default: "
                     "4096, 16384 with --full-report)",
    "report_trials": "passkey trials a context length in report.json (default: 2, 8 with "
                     "--full-report)",
    "full_report": "report.json at 512 and 2,048 tokens with passkey at 1K and 2K (the "
                   "default report: 512 tokens, passkey at 1K; or run hyla eval compare "
                   "TEACHER STUDENT later)",
    "report_tasks": "comma-separated lm-eval tasks scored on teacher and student in "
                    "report.json (default: none)",
    "include_path": "a folder of local lm-eval task YAML files for --report-tasks (default: "
                    "none)",
    "eval_data": "held-out text of the report (default: the stdlib validation split)",
    "data": "training text: a file, a folder, .jsonl or .parquet (default: the embedded "
            "stdlib corpus)",
    "chat_data": "teacher conversations mixed into the training data: this many requests "
                 "(from the stdlib's functions) answered by the teacher in its chat template; "
                 "0: none (needs a chat template; mixed with the stdlib corpus or a --data "
                 "folder)",
    "chat_share": "the conversations' share of the training tokens (default: %(default)s)",
    "batch_size": "blocks a step",
    "shuffle_buffer": "blocks of --seq-len mixed at once (stage 1 holds as many tokens)",
    "optimizer": "muon (Muon on matrices, AdamW on the rest) or adamw",
    "lr": "stage 2 learning rate (AdamW, and Muon's AdamW-side parameters)",
    "muon_lr": "stage 2 Muon learning rate",
    "stage1_lr": "stage 1 learning rate (AdamW side)",
    "stage1_muon_lr": "stage 1 Muon learning rate",
    "attn_kl_weight": "stage 1: weight of the attention-map KL of the compressed layers",
    "kl_weight": "stage 2: weight of the vocabulary KL to the teacher",
    "ce_weight": "stage 2: weight of the next-token cross-entropy",
    "temperature": "stage 2: softmax temperature of the vocabulary KL",
    "vocab_chunk": "tokens a chunk of the stage-2 vocabulary KL (bounds its memory)",
    "warmup_steps": "learning-rate warmup steps of each stage",
    "decay_fraction": "final fraction of each stage's steps with a linearly decaying rate",
    "clip": "gradient-norm clipping",
    "weight_decay": "AdamW weight decay",
    "activation_checkpointing": "recompute each block in the backward pass (less memory)",
    "save_every": "steps between checkpoints",
    "keep_last": "checkpoints kept",
    "eval_batches": "held-out batches a validation loss",
    "seed": "random seed (data order, new parameters)",
}


def add_distill(sub) -> argparse.ArgumentParser:
    """Register ``hyla distill`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("distill", help="distil an attention teacher into a hybrid student")
    defaults = DistillConfig()
    for field in dataclasses.fields(DistillConfig):
        if field.name == "precision":
            continue
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        helptext = _HELP.get(field.name)
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=helptext)
        elif field.name in _CHOICES:
            p.add_argument(flag, choices=_CHOICES[field.name], default=default, help=helptext)
        else:
            if field.name in RECIPE_FIELDS:
                value = RECIPES[DEFAULT_RECIPE].settings()[field.name]
                helptext = f"{helptext} (default: from --recipe; {DEFAULT_RECIPE}: {value})"
            kind = _NONE_DEFAULT_TYPES.get(field.name, type(default))
            p.add_argument(flag, type=kind, default=default, help=helptext)
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the distillation in DIR from its newest checkpoint")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (logs and CI); metrics.jsonl is written either way")
    p.set_defaults(func=cmd_distill)
    return p


def add_export(sub) -> argparse.ArgumentParser:
    """Register ``hyla export`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("export", help="write a hyla model in a format transformers loads")
    p.add_argument("--format", default="transformers", choices=["transformers", "llama", "fla"],
                   help="transformers: a model loaded from a transformers family (Qwen3-Next, "
                        "Kimi Linear, ...) in that family's format, an all-attention model as "
                        "Llama / Qwen / Mistral; llama: all-attention models only; fla: GLA + "
                        "attention hybrids (flash-linear-attention's GLAForCausalLM)")
    p.add_argument("source", nargs="?", default=None, metavar="checkpoint",
                   help=f"the model: {SOURCE_HELP} (or --checkpoint)")
    p.add_argument("out", help="output directory (loads with transformers)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the model files of an export already in OUT (a training "
                        "run's directory is refused either way)")
    p.add_argument("--checkpoint", default=None, help="the model, as the positional argument")
    p.set_defaults(func=cmd_export)
    return p


COMMANDS = {"distill": add_distill, "export": add_export}


def cmd_distill(args: argparse.Namespace, out: Console) -> int:
    from hyla.train.distill import Distiller

    if args.resume:
        distiller = Distiller(resume=args.resume, log=out.print, answer=engine_answers)
    else:
        names = {f.name for f in dataclasses.fields(DistillConfig)}
        cfg = DistillConfig(**{k: v for k, v in vars(args).items() if k in names})
        refuse_existing_run(cfg.out, "distill")
        distiller = Distiller(cfg, log=out.print, answer=engine_answers)
    cfg, student = distiller.cfg, distiller.model
    out.print(f"distilling {cfg.teacher} ({distiller.teacher.num_parameters():,} parameters) "
              f"into {student.num_parameters():,} parameters, {student.cfg.n_kv_heads} KV "
              f"heads -> {distiller.out}")
    record = distiller.fit(progress=not args.no_progress)
    out.print(finished_line(record, distiller.out, stage=True))
    return 0


def cmd_export(args: argparse.Namespace, out: Console) -> int:
    from hyla.model.formats.hf import export_hf
    from hyla.model.load import load_model as load_source

    if (args.source is None) == (args.checkpoint is None):
        raise ValueError("export needs the model once: hyla export SOURCE OUT or "
                         "hyla export --checkpoint SOURCE OUT")
    refuse_existing_run(args.out, "export", hint="give another OUT")
    held = [p.name for p in pathlib.Path(args.out).glob("*")
            if p.name == "config.json" or p.suffix == ".safetensors"]
    if held and not args.overwrite:
        raise ValueError(f"{args.out} already holds a model ({', '.join(sorted(held)[:3])}): "
                         f"--overwrite replaces it, or give another OUT")
    model, tok = load_source(args.checkpoint or args.source)
    if args.format == "fla":
        from hyla.model.formats.fla import export_fla

        target = export_fla(model, tok, args.out)
    else:
        target = export_hf(model, tok, args.out, fmt=args.format)
    n = model.num_parameters()
    if model.mtp is not None and not _holds_mtp(target):
        n -= sum(p.numel() for p in model.mtp.parameters())
        out.print(f"[yellow]note[/]: the model's multi-token-prediction head "
                  f"({model.cfg.mtp_layers} layer(s), --speculative mtp) has no place in "
                  f"{args.format}'s format and is left out (hyla's own checkpoint, and "
                  f"Qwen3-Next's, Qwen3.5's and MiMo-V2-Flash's transformers formats, keep "
                  f"it)")
    out.print(f"wrote {target} ({args.format}, {n:,} parameters)")
    return 0


def _holds_mtp(target) -> bool:
    """Whether an export's safetensors files hold any MTP tensor (``mtp.*``, MiMo's
    ``model.mtp.*``)."""
    from safetensors import safe_open

    for f in pathlib.Path(target).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            if any(k.startswith(("mtp.", "model.mtp.")) for k in st.keys()):  # noqa: SIM118
                return True
    return False


def engine_answers(teacher, prompts: list[list[int]], max_tokens: int,
                   stop_ids: tuple[int, ...]) -> list[list[int]]:
    """The teacher's greedy answers to ``prompts``, 16 at a time in hyla's serving engine
    (``hyla distill --chat-data``: about 2x faster than one at a time)."""
    from hyla.serve.engine import Engine, EngineConfig
    from hyla.serve.sequence import SamplingParams

    engine = Engine(teacher, None, EngineConfig(
        max_num_seqs=16, max_model_len=max(map(len, prompts)) + max_tokens + 8))
    done = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   stop_token_ids=stop_ids))
    return [d.output_ids for d in done]


"""A model checkpoint directory: ``config.json`` + ``model.safetensors`` (+ ``tokenizer.json``).

This is the directory that ``hyla generate --checkpoint``, ``hyla eval`` and (later)
``hyla serve`` load. Weights are safetensors only: loading never unpickles anything. Files are
written to a temporary name and renamed, so a crash mid-save never leaves a half-written file
under the real name, and an existing checkpoint is only replaced by a complete one.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hyla.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from hyla.model.config import HylaConfig
from hyla.model.formats.hf.tokenizer import hf_form, load_hf_tokenizer
from hyla.model.model import HylaLM

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"


def save_checkpoint(model: HylaLM, out_dir: str | os.PathLike,
                    tokenizer: BPETokenizer | ByteTokenizer | None = None) -> pathlib.Path:
    """Write ``model`` (and a BPE ``tokenizer``) to ``out_dir``; returns the directory.

    Example:
        >>> import tempfile
        >>> from hyla.model import preset
        >>> d = save_checkpoint(HylaLM(preset("debug")), tempfile.mkdtemp())
        >>> sorted(p.name for p in d.iterdir())
        ['config.json', 'model.safetensors']
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Tied weights share storage; safetensors refuses shared tensors, so store them once.
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (model.cfg.tie_embeddings and k == "lm_head.weight")}
    _atomic(out / WEIGHTS, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    config = json.dumps(model.cfg.to_dict(), indent=2) + "\n"
    _atomic(out / CONFIG, lambda tmp: tmp.write_text(config, encoding="utf-8"))
    tokenizer = hf_form(tokenizer)      # Kimi's tiktoken: as a tokenizer.json
    if isinstance(tokenizer, BPETokenizer):
        _atomic(out / TOKENIZER, tokenizer.save)
    return out


def load_checkpoint(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> tuple[HylaLM, ByteTokenizer]:
    """Load a checkpoint directory; returns (model in eval mode, tokenizer).

    ``path`` may also be a training run's output directory: its newest ``ckpt-<step>`` loads.
    Raises ValueError naming the file when the directory, its config or its weights are
    missing, corrupt or do not match each other.
    """
    root = latest_checkpoint(pathlib.Path(path))
    if not root.is_dir():
        raise ValueError(f"checkpoint {str(root)!r} is not a directory: expected one holding "
                         f"{CONFIG} and {WEIGHTS} (written by hyla train or save_checkpoint)")
    for name in (CONFIG, WEIGHTS):
        if not (root / name).is_file():
            raise ValueError(f"checkpoint {str(root)!r} has no {name}: expected {CONFIG} and "
                             f"{WEIGHTS}")
    try:
        cfg = HylaConfig(**json.loads((root / CONFIG).read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{root / CONFIG} is not a valid hyla config: {e}") from e
    with torch.device("meta"):
        model = HylaLM(cfg)
    _check_shapes(model, root / WEIGHTS, root / CONFIG)    # before allocating anything
    try:
        weights = load_file(str(root / WEIGHTS), device=str(device))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{root / WEIGHTS} could not be read as safetensors: {e}") from e
    model = model.to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.load_state_dict(weights, strict=False)
    if dtype is not None:
        model = model.to(dtype)
    if (root / "tokenizer_config.json").is_file() and (root / TOKENIZER).is_file():
        # a transformers model's tokenizer kept its special tokens and chat template there
        return model.eval(), load_hf_tokenizer(root, cfg.vocab_size)
    return model.eval(), load_tokenizer(root)


def _check_shapes(model: HylaLM, weights: pathlib.Path, config: pathlib.Path) -> None:
    """ValueError unless the file's tensors are exactly the model's, by name and shape."""
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{weights} could not be read as safetensors: {e}") from e
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        want.pop("lm_head.weight", None)
        shapes.pop("lm_head.weight", None)
    missing = [k for k in want if k not in shapes]
    unexpected = [k for k in shapes if k not in want]
    if missing or unexpected:
        raise ValueError(f"{weights} does not match {config}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    wrong = [f"{k} {shapes[k]} (expected {want[k]})" for k in want if shapes[k] != want[k]]
    if wrong:
        raise ValueError(f"{weights} does not match {config}: shapes of {wrong[:3]}")


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of a ``ckpt-<step>`` directory name, None for any other name.

    Example:
        >>> checkpoint_step("runs/a/ckpt-1000000"), checkpoint_step("runs/a/.ckpt-1.tmp-9")
        (1000000, None)
    """
    name = pathlib.Path(path).name
    return int(name[5:]) if name.startswith("ckpt-") and name[5:].isdigit() else None


def step_dirs(run_dir: str | os.PathLike) -> list[pathlib.Path]:
    """The ``ckpt-<step>`` directories of a run, oldest first by their *parsed* step (as
    names, ``ckpt-1000000`` would sort before ``ckpt-999000``). Every place that lists a
    run's checkpoints (load, resume, pruning) goes through here.

    Example:
        >>> import tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> for s in ("ckpt-999000", "ckpt-1000000", "ckpt-998000"): (d / s).mkdir()
        >>> [p.name for p in step_dirs(d)]
        ['ckpt-998000', 'ckpt-999000', 'ckpt-1000000']
    """
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(step, p) for p in run_dir.glob("ckpt-*")
             if (step := checkpoint_step(p)) is not None and p.is_dir()]
    return [p for _, p in sorted(found, key=lambda sp: (sp[0], sp[1].name))]


def latest_checkpoint(path: pathlib.Path) -> pathlib.Path:
    """A training run's directory resolves to its newest ``ckpt-<step>``; others to themselves."""
    steps = step_dirs(path)
    return steps[-1] if steps and not (path / CONFIG).is_file() else path


def _atomic(target: pathlib.Path, write) -> None:
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)

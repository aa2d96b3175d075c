"""Checks every hybrid family's test runs against its small random transformers model:
relative error, prefill in chunks + decode against the forward, and export (hyla reads it
back bit for bit, transformers reads it with equal logits)."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from hyla.model import load_model
from hyla.model.formats.hf import export_hf


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def save(model, path, bpe):
    """``model.save_pretrained(path)`` with ``bpe`` as its tokenizer.json; returns path."""
    model.save_pretrained(path)
    bpe.save(path / "tokenizer.json")
    return path


def tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def check_prefill_decode(model, ids: torch.Tensor, full: torch.Tensor, cuts: tuple[int, ...],
                         tol: float = 1e-4) -> float:
    """Prefill ``ids`` [T] in chunks ending at ``cuts``, then decode the rest token by token:
    the logits must equal ``full`` [T, vocab] (the forward's) within ``tol``."""
    state, start, steps = model.new_state(), 0, []
    with torch.no_grad():
        for end in cuts:
            steps.append(model.prefill(ids[start:end], state))
            start = end
        steps += [model.decode(ids[t:t + 1], [state]) for t in range(start, ids.numel())]
    err = rel(torch.cat(steps), full)
    assert err <= tol, err
    return err


def check_export(model, tok, out, transformers, ref, ids: torch.Tensor,
                 tol: float = 1e-4) -> None:
    """``hyla export --format transformers`` of ``model``: load_model reads it back bit for
    bit with the same config, its config.json names the family, and transformers loads it
    with logits equal to ``ref``'s on ``ids``."""
    export_hf(model, tok, out, fmt="transformers")
    back, _ = load_model(out)
    assert back.cfg == model.cfg
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "config.json").read_text())["model_type"] == model.cfg.family
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel(again(ids).logits, ref(ids).logits) <= tol


def edit_config(path, **changes) -> None:
    """Change (or, with None, remove) fields of ``path/config.json``."""
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))

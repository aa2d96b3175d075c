"""Validation perplexity of a model on a text source, with the token count it rests on."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from hyla.data.corpus import iter_documents


@torch.no_grad()
def perplexity(model, tokenizer, data: str | os.PathLike | None = None, *, seq_len: int = 512,
               max_tokens: int = 65536, batch_size: int = 4) -> dict:
    """Mean next-token loss over non-overlapping windows of ``seq_len`` tokens.

    Documents (default: the stdlib corpus's validation split) are tokenized and packed into
    windows; every window is scored from its first token, so each document boundary is a
    plain token boundary and the first token of every window is not predicted.
    Returns {"perplexity", "loss", "tokens" (predicted), "windows", "seq_len"}.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> from hyla.data import ByteTokenizer
        >>> r = perplexity(HylaLM(preset("debug")), ByteTokenizer(), seq_len=64, max_tokens=256)
        >>> r["tokens"], r["windows"]
        (252, 4)
    """
    if seq_len < 2 or max_tokens < seq_len:
        raise ValueError(f"need 2 <= seq_len <= max_tokens, got seq_len={seq_len}, "
                         f"max_tokens={max_tokens}")
    ids: list[int] = []
    for doc in iter_documents(data, "validation"):
        ids.extend(tokenizer.encode(doc + "\n"))
        if len(ids) >= max_tokens:
            break
    n_windows = min(len(ids), max_tokens) // seq_len
    if n_windows == 0:
        raise ValueError(f"data holds {len(ids)} tokens, fewer than one window of {seq_len}")
    windows = torch.tensor(ids[: n_windows * seq_len]).view(n_windows, seq_len)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        logits = model(batch).float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                               batch[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    mean = total / count
    return {"perplexity": math.exp(mean), "loss": mean, "tokens": count, "windows": n_windows,
            "seq_len": seq_len}

"""One model's held-out figures: perplexity, passkey retrieval, state bytes and parameters;
what the distillation report and ``hyla eval compare`` put side by side."""

from __future__ import annotations

import torch

from hyla.eval.memory import state_bytes
from hyla.eval.needle import needle_eval
from hyla.eval.perplexity import perplexity

PPL_LENGTHS = (512, 2048)
PASSKEY_LENGTHS = (1024, 2048)
PASSKEY_DEPTHS = (0.25, 0.75)
STATE_CONTEXT = 8192


def model_report(model, tokenizer, *, data=None, tokens: int = 16384, trials: int = 8,
                 lengths: tuple[int, ...] = PPL_LENGTHS,
                 passkey_lengths: tuple[int, ...] = PASSKEY_LENGTHS) -> dict:
    """Held-out perplexity at each of ``lengths`` (``tokens`` tokens, or more where a window
    needs more), passkey accuracy at each of ``passkey_lengths`` (``trials`` a context
    length, half at each of two depths), state bytes at 8K and parameters of one model.

    Example:
        >>> from hyla.data import ByteTokenizer
        >>> from hyla.model import HylaLM, preset
        >>> r = model_report(HylaLM(preset("debug")), ByteTokenizer(), tokens=4096, trials=2)
        >>> sorted(r["perplexity"]), r["state_bytes_8k_bf16"] < r["state_bytes_8k"]
        (['2048', '512'], True)
    """
    was_training = model.training
    model.eval()
    ppl = {}
    for n in lengths:
        r = perplexity(model, tokenizer, data, seq_len=n, max_tokens=max(tokens, n), batch_size=1)
        ppl[str(n)] = {"perplexity": r["perplexity"], "tokens": r["tokens"]}
    passkey = {}
    for n in passkey_lengths:
        cells = needle_eval(model, tokenizer, [n], PASSKEY_DEPTHS,
                            trials=max(1, trials // len(PASSKEY_DEPTHS)))
        passkey[str(n)] = {"correct": sum(c["correct"] for c in cells),
                           "trials": sum(c["trials"] for c in cells)}
    dtype = next(model.parameters()).dtype
    model.train(was_training)
    return {"perplexity": ppl, "passkey": passkey,
            "state_bytes_8k": state_bytes(model.cfg, STATE_CONTEXT, dtype)["total"],
            # served in bf16: caches halve, recurrent matrices stay fp32
            "state_bytes_8k_bf16": state_bytes(model.cfg, STATE_CONTEXT, torch.bfloat16)["total"],
            "parameters": model.num_parameters()}

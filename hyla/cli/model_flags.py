"""Flags on how a loaded model is held in memory, shared by the commands that run one:
``--quantize`` (weight-only int8/int4) and ``--kv-cache-memory`` (the paged KV budget).
Imports no command module.
"""

from __future__ import annotations

import argparse
import os
import re

from rich.console import Console

from hyla.cli.common import format_bytes

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def add_quantize(p: argparse.ArgumentParser) -> None:
    from hyla.model.quantize import SCHEMES

    p.add_argument("--quantize", choices=("auto", *SCHEMES), default="auto",
                   help="keep the weights quantised in memory and compute with weight-only "
                        "int8 (per channel) or int4 (groups of 32, the output layer int8) "
                        "matmuls; '-a8': decode batches multiply 8-bit rotated activations "
                        "(faster, about +0.1%% perplexity; needs AVX512-VNNI); CPU only. "
                        "auto (the default): a GGUF file's own quantisation mapped to the "
                        "nearest scheme (Q4_* -> int4, Q8_0 -> int8; -a8 where VNNI runs) "
                        "on a CPU, else none")


def resolve_quantize(model, scheme: str) -> tuple[str, str]:
    """(the scheme ``--quantize scheme`` runs for ``model``, why, where it is not the one
    asked): ``auto`` is the scheme nearest a GGUF file's own weights
    (``model.source_quantization``, set by the GGUF loader), with 8-bit activations
    (``-a8``) where the CPU has VNNI. A scheme the machine cannot run falls back, with the
    reason, rather than failing: off the CPU to ``none`` (the quantised kernels are CPU
    only), ``-a8`` without VNNI to its weights' scheme with 16-bit activations."""
    from hyla.model.vnni_int8 import vnni_int8_available

    if scheme == "none":
        return scheme, ""
    first = next(model.parameters(), None)
    if first is not None and first.device.type != "cpu":
        kind, nearest = getattr(model, "source_quantization", ("", "none"))
        if scheme == "auto" and nearest == "none":
            return "none", ""
        what = f"the file's {kind} weights" if scheme == "auto" else "the weights"
        return "none", (f"--quantize {scheme}: {what} kept in float on "
                        f"{first.device.type} (the quantised kernels are CPU only)")
    if scheme == "auto":
        kind, nearest = getattr(model, "source_quantization", ("", "none"))
        if nearest == "none":
            return "none", ""
        if vnni_int8_available():
            # llama.cpp multiplies its 4- and 8-bit blocks by activations quantised to 8
            # bits (Q8_1, Q8_0); -a8 does the same in decode batches, rotated, for +0.11%
            # perplexity on SmolLM2 and half the int8 work of 16-bit activations
            return f"{nearest}-a8", (f"--quantize auto: {nearest}-a8, nearest the file's "
                                     f"{kind} weights (8-bit activations in decode batches, "
                                     f"as llama.cpp runs them)")
        return nearest, f"--quantize auto: nearest the file's {kind} weights"
    if scheme.endswith("-a8") and not vnni_int8_available():
        plain = scheme.removesuffix("-a8")
        return plain, (f"--quantize {scheme}: this CPU (or torch build) has no AVX512-VNNI "
                       f"for fbgemm's int8 x int8 products, so {plain} with 16-bit "
                       f"activations instead")
    return scheme, ""


def apply_quantize(model, args: argparse.Namespace, out: Console | None = None):
    """Quantise ``model`` in place as ``--quantize`` says; prints what it saved."""
    for line in quantize_notes(model, args):
        if out is not None:
            out.print(line)
    return model


def quantize_notes(model, args: argparse.Namespace) -> list[str]:
    """Quantise ``model`` in place as ``--quantize`` says; returns the lines that say how."""
    from hyla.model.quantize import quantize_model

    scheme, why = resolve_quantize(model, getattr(args, "quantize", "none"))
    report = quantize_model(model, scheme)
    notes = [why] if why else []
    if scheme != "none":
        notes.append(f"quantised {report.layers} linear layers to {scheme} "
                     f"({report.int4_layers} int4): weights {format_bytes(report.bytes_before)} "
                     f"-> {format_bytes(report.bytes_after)}")
    return notes


def drafter(args: argparse.Namespace, model, tok, out: Console | None = None):
    """The drafter ``--speculative`` asks for ``model`` (None without it): n-gram lookup, the
    model's MTP layers, or the ``draft:SOURCE`` model loaded and quantised as
    ``--draft-quantize`` says."""
    from hyla.serve.draft_model import ModelDrafter
    from hyla.serve.speculative import NgramDrafter

    method = getattr(args, "speculative", None)
    if method is None:
        return None
    if method == "mtp":
        from hyla.serve.mtp_drafter import check_mtp

        check_mtp(model)            # first: the flag cannot work with this model at all
    why = (f"it speeds up greedy decoding, --temperature 0; this is {args.temperature}"
           if getattr(args, "temperature", 0) > 0 else     # generate's and chat's loop
           "it does not run with --json-schema" if getattr(args, "json_schema", None)
           else None)
    if why is not None:
        if out is not None:
            out.print(f"--speculative {method}: not used ({why})")
        return None
    if method == "ngram":
        return NgramDrafter(args.num_speculative_tokens)
    if method == "mtp":
        from hyla.serve.mtp_drafter import MTPDrafter

        return MTPDrafter(model, args.num_speculative_tokens)
    return ModelDrafter(draft_model(args, model, tok, out), args.num_speculative_tokens,
                        vocab=model.cfg.vocab_size)


def drafts_kept(args: argparse.Namespace, draft) -> str:
    """The stats line's note of how many drafts were kept ("" without a drafter)."""
    if draft is None:
        return ""
    return f"; {args.speculative} drafts: {draft.accepted} of {draft.drafted} kept"


def draft_model(args: argparse.Namespace, model, tok, out: Console | None = None):
    """The model of ``--speculative draft:SOURCE`` for ``model``, quantised as
    ``--draft-quantize`` says (None with another method)."""
    from hyla.model.quantize import quantize_model
    from hyla.serve.draft_model import DRAFT_PREFIX, load_draft

    method = getattr(args, "speculative", None) or ""
    if not method.startswith(DRAFT_PREFIX):
        return None
    draft = load_draft(method[len(DRAFT_PREFIX):], model, tok)
    scheme, why = resolve_quantize(draft, getattr(args, "draft_quantize", "auto"))
    report = quantize_model(draft, scheme)
    if out is not None:
        size = report.bytes_after if scheme != "none" else sum(
            p.numel() * p.element_size() for p in draft.parameters())
        out.print(f"draft model {method[len(DRAFT_PREFIX):].strip()}: weights {scheme} "
                  f"({format_bytes(size)})"
                  + (f"; {why.replace('--quantize', '--draft-quantize', 1)}" if why else ""))
    return draft


def add_weights_cache(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-weights-cache", action="store_true",
                   help="load and quantise the checkpoint on every start, without the "
                        "prepared-weights cache (what --quantize made of a file, kept in "
                        "$HYLA_WEIGHTS_CACHE, default ~/.cache/hyla/prepared, so that the "
                        "next start skips the work)")


def load_quantized(args: argparse.Namespace, out: Console | None, load, *,
                   variant: str = "", device: str = "cpu"):
    """(model, tokenizer, whether the prepared-weights cache held it) of ``--checkpoint``
    quantised as ``--quantize`` says: from the cache (:mod:`hyla.model.prepared`) where it
    holds the entry, else ``load()`` (model, tokenizer) then quantised, and kept for the next
    start. ``variant``: what else the prepared model depends on (``--dtype``)."""
    from hyla.model.prepared import cache_root, load_prepared

    def prepare():
        model, tok = load()
        return model, tok, quantize_notes(model, args)

    model, tok, notes, hit = load_prepared(
        args.checkpoint, getattr(args, "quantize", "none"), prepare, variant=variant,
        device=device, use=not getattr(args, "no_weights_cache", False))
    if out is not None:
        for line in notes:
            out.print(line)
        if hit:
            out.print(f"prepared weights read from {cache_root()} (--no-weights-cache: "
                      f"from the checkpoint)")
    return model, tok, hit


def byte_size(value: str) -> int:
    """argparse type: bytes as ``2G``, ``512MB``, ``1GiB``, ``1000000``, or a fraction of
    this machine's memory below 1 (``0.1``).

    Example:
        >>> byte_size("512M"), byte_size("1GiB"), byte_size("1000")
        (512000000, 1073741824, 1000)
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected bytes such as 2G, 512MB or 1GiB, or a "
                                         f"fraction of memory such as 0.1, got {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {value!r}")
    if not unit and number < 1:
        return int(number * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return int(number * _UNITS[unit])


def add_kv_cache_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-memory", type=byte_size, default=None, metavar="SIZE",
                   help="bytes for the attention layers' paged KV cache (2G, 512MB, or a "
                        "fraction of RAM such as 0.1); at least one --max-model-len sequence "
                        "(default: enough for --max-num-seqs full-length sequences)")


def add_kv_cache_dtype(p: argparse.ArgumentParser) -> None:
    # the names of hyla.serve.engine.KV_DTYPES (not imported: building the parser stays light)
    p.add_argument("--kv-cache-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="dtype of the attention layers' paged KV cache, choices auto, "
                        "float32, bfloat16; auto: the model's (--dtype), so outputs are "
                        "exactly the model's, but bfloat16 under --quantize'd weights; "
                        "bfloat16 under a float32 model halves the cache's bytes (default: "
                        "%(default)s)")

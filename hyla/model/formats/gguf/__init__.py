"""GGUF files as llama.cpp writes them: :mod:`.reader` (hyla's own walk of the header and
tensors, quantised blocks kept), :mod:`.load` (architectures onto a
:class:`~hyla.model.HylaConfig`, :func:`load_gguf`, :func:`nearest_scheme`) and
:mod:`.tokenizer` (the vocabulary and merges in the file's metadata)."""

from hyla.model.formats.gguf.load import (
    ARCHITECTURES,
    gguf_config,
    gguf_weights,
    load_gguf,
    load_gguf_tokenizer,
    nearest_scheme,
    open_gguf,
)

__all__ = ["ARCHITECTURES", "gguf_config", "gguf_weights", "load_gguf", "load_gguf_tokenizer",
           "nearest_scheme", "open_gguf"]

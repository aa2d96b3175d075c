"""Model formats in and out: hyla checkpoints (:mod:`.checkpoint`), ``transformers``
directories (:mod:`.hf`, tokenizers in :mod:`.hf_tokenizer`), GGUF files (:mod:`.gguf`) and
flash-linear-attention GLA directories (:mod:`.fla`). :func:`hyla.model.load_model` picks
the right one for a source; import the modules themselves for format-specific functions."""

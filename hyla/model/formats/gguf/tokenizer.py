"""A GGUF file's byte-level BPE tokenizer, built with ``tokenizers`` from its metadata.

A GGUF has no ``tokenizer.json``: llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``),
the merges, each token's type and the special token ids as metadata. For byte-level BPE
(``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3, Qwen 2/3) this builds the tokenizer
``transformers``' GGUF conversion builds (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``), without importing ``transformers`` (seconds of imports):

- a BPE model over the vocabulary (tokens outside the byte alphabet respelled in it) and the
  merges; a ByteLevel pre-tokenizer with GPT-2's split, or the split the file's
  ``tokenizer.ggml.pre`` names (:data:`SPLITS`), and a ByteLevel decoder;
- control tokens (type 3) added as special tokens, user-defined ones (type 4) as plain
  added tokens, the named BOS/EOS/UNK/PAD tokens as special tokens;
- a BOS (EOS) added to every text when ``tokenizer.ggml.add_bos_token``
  (``add_eos_token``) says so.

Any other tokenizer model (sentencepiece ``llama``, ``t5``, ...) or a ``pre`` type whose split
is not in :data:`SPLITS` returns None: the caller converts it through ``transformers``.

Example:
    >>> meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab", "<e>"],
    ...         "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1, 3],
    ...         "tokenizer.ggml.eos_token_id": 3}
    >>> tok = byte_level_bpe(meta)
    >>> tok.encode("ab<e>").ids
    [2, 3]
"""

from __future__ import annotations

# transformers' GGUF conversion (integrations/gguf/gguf_tokenizer_mapping.py) splits text
# with these for the ``tokenizer.ggml.pre`` values named; every other value gets GPT-2's.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: Qwen2's with combining marks kept inside words (llama.cpp's QWEN35 pre-type)
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"qwen35": _QWEN35,
          **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                           "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
          **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2)}
# ``pre`` values transformers splits some other way, which is not rebuilt here
_OTHER_SPLITS = frozenset({"tekken", "gpt-4o", "llama4", "kanana2", "talkie",
                           "minimax-m2"})
_CONTROL, _USER_DEFINED = 3, 4
_NAMED = ("bos", "eos", "unknown", "padding")


def special_token(meta: dict, name: str) -> str | None:
    """The text of the token ``tokenizer.ggml.<name>_token_id`` names, or None."""
    i = meta.get(f"tokenizer.ggml.{name}_token_id")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def byte_level_bpe(meta: dict):
    """The ``tokenizers.Tokenizer`` of a GGUF's byte-level BPE metadata (see the module
    docstring), or None when this file's tokenizer is not one built here."""
    if meta.get("tokenizer.ggml.model") != "gpt2" or "tokenizer.ggml.merges" not in meta:
        return None
    pre = meta.get("tokenizer.ggml.pre")
    if pre in _OTHER_SPLITS:
        return None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, processors
    from tokenizers import pre_tokenizers as pre_tok

    from hyla.model.formats.hf.tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab = {}
    for i, t in enumerate(tokens):
        key = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
        vocab[key] = i
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False))
    byte_level = pre_tok.ByteLevel(add_prefix_space=False)
    if pre in SPLITS:
        byte_level = pre_tok.Sequence([
            pre_tok.Split(Regex(SPLITS[pre]), behavior="isolated"),
            pre_tok.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()

    types = meta.get("tokenizer.ggml.token_type") or ()
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types, strict=False)
               if kind == _CONTROL and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)
    known = tok.get_vocab(with_added_tokens=True)
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False) if kind == _USER_DEFINED and t in known]
    if user:
        tok.add_tokens(user)
    added = {a.content for a in tok.get_added_tokens_decoder().values()}
    named = [t for t in (special_token(meta, n) for n in _NAMED) if t is not None]
    extra = [AddedToken(t, special=True) for t in dict.fromkeys(named) if t not in added]
    if extra:
        tok.add_tokens(extra)

    bos, eos = special_token(meta, "bos"), special_token(meta, "eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token")) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token")) and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = (f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1"
            f"{' ' + eos + ':1' if add_eos else ''}")
    specials = ([(bos, tok.token_to_id(bos))] if add_bos else []) + (
        [(eos, tok.token_to_id(eos))] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=specials)
    return tok

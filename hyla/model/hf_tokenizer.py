"""Tokenizers between transformers directories and hyla checkpoints.

hyla keeps a tokenizer as a ``tokenizers`` JSON file whose end-of-document token is
``<|endoftext|>`` (:class:`hyla.data.tokenizer.BPETokenizer`), or as raw bytes
(:class:`hyla.data.tokenizer.ByteTokenizer`, no file). What is supported:

- import: ``tokenizer.json`` is required (a sentencepiece ``tokenizer.model`` alone is not
  read). A file with ``<|endoftext|>`` (Qwen2, hyla exports) is used as is; a 256-token byte
  map (what hyla exports for a byte model) becomes the byte tokenizer; a file whose
  ``tokenizer_config.json`` names an ``eos_token`` it holds (Llama's ``</s>``) ends
  documents with that; any other file gets ``<|endoftext|>`` appended as a special token
  when the model's vocabulary has a spare id, and is refused otherwise.
  A tokenizer with more ids than the model's ``vocab_size`` is refused;
- export: ``tokenizer.json`` + ``tokenizer_config.json`` (``PreTrainedTokenizerFast``), which
  ``transformers.AutoTokenizer`` loads. A byte model gets a byte-identity BPE (no merges) whose
  id ``b`` is byte ``b``.
"""

from __future__ import annotations

import json
import pathlib

from hyla.data.tokenizer import EOS, BPETokenizer, ByteTokenizer, config_eos_token


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies use.

    Example:
        >>> m = bytes_to_unicode()
        >>> len(m), m[ord("a")], m[ord(" ")]
        (256, 'a', 'Ġ')
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def byte_tokenizer_json():
    """A ``tokenizers.Tokenizer`` whose id ``b`` is byte ``b`` (the hyla byte vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _is_byte_map(tok) -> bool:
    vocab = tok.get_vocab(with_added_tokens=True)
    return len(vocab) == 256 and all(vocab.get(ch) == b for b, ch in bytes_to_unicode().items())


def load_hf_tokenizer(root: pathlib.Path, vocab_size: int) -> BPETokenizer | ByteTokenizer:
    """The tokenizer of a transformers directory, as a hyla tokenizer (see module docstring)."""
    from tokenizers import AddedToken, Tokenizer

    path = root / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{root} has no tokenizer.json: expected a Hugging Face tokenizers file "
                         f"(a sentencepiece tokenizer.model alone is not supported)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exceptions for bad files
        raise ValueError(f"{path} is not a tokenizers JSON file: {e}") from e
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise ValueError(f"tokenizer mismatch: {path} has {n} tokens but "
                         f"{root / 'config.json'} has vocab_size={vocab_size}: expected a "
                         f"tokenizer with at most vocab_size ids")
    if _is_byte_map(tok):
        return ByteTokenizer()
    named = config_eos_token(path)
    if tok.token_to_id(EOS) is None and named is not None and tok.token_to_id(named) is not None:
        return BPETokenizer(tok, eos_token=named)      # Llama's </s>, Llama 3's <|end_of_text|>
    if tok.token_to_id(EOS) is None:
        if n >= vocab_size:
            raise ValueError(f"{path} has no {EOS} token and the model's vocabulary "
                             f"({vocab_size} ids) has no spare id for one: hyla needs an "
                             f"end-of-document token named {EOS}")
        tok.add_special_tokens([AddedToken(EOS, special=True)])
    return BPETokenizer(tok)


def save_hf_tokenizer(tokenizer: BPETokenizer | ByteTokenizer, out: pathlib.Path) -> dict:
    """Write ``tokenizer.json`` + ``tokenizer_config.json``; returns config.json token ids."""
    if isinstance(tokenizer, BPETokenizer):
        tokenizer.save(out / "tokenizer.json")
        eos, eos_id = tokenizer.eos_token, tokenizer.eos_id
    elif isinstance(tokenizer, ByteTokenizer):
        byte_tokenizer_json().save(str(out / "tokenizer.json"))
        eos, eos_id = None, None
    else:
        raise ValueError(f"tokenizer must be a hyla BPETokenizer or ByteTokenizer, got "
                         f"{type(tokenizer).__name__}")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
              "bos_token": None, "pad_token": None, "unk_token": None,
              "clean_up_tokenization_spaces": False, "model_max_length": 32768}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                               encoding="utf-8")
    return {"eos_token_id": eos_id}

"""Byte-level tokenizer: token id = UTF-8 byte, so any text round-trips with no vocab file."""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256). Decoding replaces invalid byte runs.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hé")
        [104, 195, 169]
        >>> tok.decode([104, 195, 169])
        'hé'
    """

    vocab_size = 256
    eos_id = None  # documents are separated by cu_seqlens only

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as a list of ints in [0, 256)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Turn ids back into text; ids that are not whole UTF-8 sequences become U+FFFD.

        Ids outside [0, 256) (a model with a larger vocabulary sampled them) raise ValueError.
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return bytes(ids).decode("utf-8", errors="replace")


EOS = "<|endoftext|>"


class BPETokenizer:
    """Byte-level BPE (Hugging Face ``tokenizers``), stored as ``tokenizer.json``.

    Documents end with the end-of-text token (``eos_id``) when packed for training:
    ``<|endoftext|>`` for tokenizers hyla trains, the one a Hugging Face tokenizer names in
    its ``tokenizer_config.json`` (``</s>``, ``<|end_of_text|>``...) otherwise.

    Example:
        >>> tok = train_bpe(["def f(x):\\n    return x\\n"] * 50, vocab_size=300)
        >>> tok.decode(tok.encode("def f(x):"))
        'def f(x):'
    """

    def __init__(self, tokenizer, eos_token: str = EOS) -> None:
        self._tok = tokenizer
        self.eos_token = eos_token
        self.eos_id = tokenizer.token_to_id(eos_token)
        if self.eos_id is None:
            raise ValueError(f"tokenizer has no {eos_token} token: expected the end-of-text "
                             f"token it is given, {EOS} for tokenizers hyla trains")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` it runs (grammar engines read its vocabulary)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self._tok.encode(text).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def save(self, path) -> None:
        """Write ``path`` (tokenizer.json); a non-default end-of-text token is named in
        ``tokenizer_config.json`` beside it, the Hugging Face convention."""
        import json
        import pathlib

        self._tok.save(str(path))
        if self.eos_token != EOS:
            cfg = pathlib.Path(path).with_name("tokenizer_config.json")
            cfg.write_text(json.dumps({"eos_token": self.eos_token}) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path, eos_token: str | None = None) -> BPETokenizer:
        """Read ``path``; the end-of-text token is ``eos_token``, else the one named in a
        ``tokenizer_config.json`` beside it, else ``<|endoftext|>``."""
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exceptions for bad files
            raise ValueError(f"{path} is not a tokenizers JSON file: {e}") from e
        return cls(tok, eos_token or config_eos_token(path) or EOS)


def config_eos_token(path) -> str | None:
    """The ``eos_token`` named in the ``tokenizer_config.json`` beside ``path``, if any."""
    import json
    import pathlib

    cfg = pathlib.Path(path).with_name("tokenizer_config.json")
    if not cfg.is_file():
        return None
    try:
        eos = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{cfg} is not a JSON object: {e}") from e
    if isinstance(eos, dict):           # transformers' AddedToken form
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def train_bpe(texts: Iterable[str], vocab_size: int = 8192) -> BPETokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids (256 bytes + merges + <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + {EOS}), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok)


def load_tokenizer(directory) -> ByteTokenizer | BPETokenizer:
    """The tokenizer saved beside a checkpoint: ``tokenizer.json`` if present; else the byte
    tokenizer, but only when the ``config.json`` beside it (if any) says so, with a
    vocabulary of 256 ids. A model with a larger vocabulary and no ``tokenizer.json`` is a
    ValueError naming the missing file (falling back to bytes would serve garbage).

    Example:
        >>> import json, pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> type(load_tokenizer(d)).__name__
        'ByteTokenizer'
        >>> _ = (d / "config.json").write_text(json.dumps({"vocab_size": 8192}))
        >>> load_tokenizer(d)
        Traceback (most recent call last):
        ...
        ValueError: .../tokenizer.json is missing: ...
    """
    import json
    import pathlib

    path = pathlib.Path(directory) / "tokenizer.json"
    if path.is_file():
        return BPETokenizer.load(path)
    config = path.with_name("config.json")
    vocab = None
    if config.is_file():
        try:
            vocab = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
        except (ValueError, AttributeError):
            vocab = None            # the model loader names a bad config itself
    if vocab is not None and vocab != ByteTokenizer.vocab_size:
        raise ValueError(f"{path} is missing: {config} declares a vocabulary of {vocab} "
                         f"tokens, which needs its own tokenizer (the byte tokenizer serves "
                         f"{ByteTokenizer.vocab_size}-token vocabularies only)")
    return ByteTokenizer()


def stop_ids(tok) -> tuple[int, ...]:
    """The ids that end a generation, the end-of-text token first (as transformers'
    generate stops), then the model's other stop ids."""
    eos = getattr(tok, "eos_id", None)
    return (() if eos is None else (eos,)) + tuple(getattr(tok, "stop_ids", ()))

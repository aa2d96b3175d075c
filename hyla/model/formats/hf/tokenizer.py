"""Tokenizers between transformers directories and hyla checkpoints.

hyla keeps a tokenizer as a ``tokenizers`` JSON file whose end-of-document token is
``<|endoftext|>`` (:class:`hyla.data.tokenizer.BPETokenizer`), or as raw bytes
(:class:`hyla.data.tokenizer.ByteTokenizer`, no file). What is supported:

- import: ``tokenizer.json`` is required (a sentencepiece ``tokenizer.model`` alone is not
  read; Kimi's ``tiktoken.model`` is: :mod:`hyla.model.formats.hf.tiktoken_tokenizer`)
  and is used as is (:class:`HFTokenizer`: the ids ``transformers`` gives, BOS
  included, and the chat template of ``chat_template.jinja`` or ``tokenizer_config.json``).
  Documents end with the ``eos_token`` ``tokenizer_config.json`` names (Llama's ``</s>``),
  else the one ``config.json``'s ``eos_token_id`` names, else ``<|endoftext|>``; a file with
  none of them gets ``<|endoftext|>`` appended when the model's vocabulary has a spare id,
  and is refused otherwise. A 256-token byte map (what hyla exports for a byte model)
  becomes the byte tokenizer. A tokenizer with more ids than the model's ``vocab_size`` is
  refused;
- export: ``tokenizer.json`` + ``tokenizer_config.json`` (``PreTrainedTokenizerFast``), which
  ``transformers.AutoTokenizer`` loads. A byte model gets a byte-identity BPE (no merges) whose
  id ``b`` is byte ``b``.
"""

from __future__ import annotations

import json
import logging
import pathlib

from hyla.data.tokenizer import EOS, BPETokenizer, ByteTokenizer
from hyla.model.formats.hf.chat_template import render_chat
from hyla.model.formats.hf.tiktoken_tokenizer import TiktokenTokenizer, load_tiktoken_tokenizer

log = logging.getLogger(__name__)


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


class HFTokenizer(BPETokenizer):
    """A ``transformers`` model's tokenizer: its ``tokenizers`` file as is (the same ids as
    ``transformers``' fast tokenizer, special tokens such as a BOS added by its post-processor
    included), its end-of-text token, and its chat template, rendered with Jinja as
    ``transformers`` renders it (:meth:`apply_chat_template`).

    Example:
        >>> from tokenizers import Tokenizer, models
        >>> t = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2}, unk_token="<s>"))
        >>> tok = HFTokenizer(t, "</s>", chat_template="{{ bos_token }}{% for m in messages %}"
        ...                   "{{ m['content'] }}{% endfor %}", bos_token="<s>")
        >>> tok.apply_chat_template([{"role": "user", "content": "hi"}])
        '<s>hi'
        >>> tok.encode("hi"), tok.eos_id
        ([2], 1)
    """

    # ids besides ``eos_id`` that end a generation (the model's generation_config.json)
    stop_ids: tuple[int, ...] = ()

    def __init__(self, tokenizer, eos_token: str, *, chat_template: str | None = None,
                 bos_token: str | None = None):
        super().__init__(tokenizer, eos_token)
        self.chat_template = chat_template or None
        self.bos_token = bos_token
        self.bos_id = tokenizer.token_to_id(bos_token) if bos_token else None

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        # A rendered chat template already starts with the BOS text: adding the
        # post-processor's BOS again would double it (transformers' apply_chat_template
        # encodes without special tokens for the same reason).
        special = not (self.bos_token and text.startswith(self.bos_token))
        return self._tok.encode(text, add_special_tokens=special).ids

    def apply_chat_template(self, messages: list[dict], *, tokenize: bool = False,
                            add_generation_prompt: bool = True, **kwargs):
        """The prompt text (or ids, with ``tokenize``) of ``messages`` under the chat
        template; ValueError when the tokenizer has none."""
        text = render_chat(self, messages, add_generation_prompt, **kwargs)
        return self._tok.encode(text, add_special_tokens=False).ids if tokenize else text

    def save(self, path) -> None:
        """Write ``tokenizer.json`` and a ``tokenizer_config.json`` naming the special
        tokens and the chat template, the Hugging Face layout."""
        self._tok.save(str(path))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token,
               "bos_token": self.bos_token}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        pathlib.Path(path).with_name("tokenizer_config.json").write_text(
            json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


def _token_text(value) -> str | None:
    if isinstance(value, dict):             # transformers' AddedToken form
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_object(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _config_eos(root: pathlib.Path, tok) -> str | None:
    """The EOS token ``config.json``'s ``eos_token_id`` names (the first, for a list)."""
    eos_id = _read_object(root / "config.json").get("eos_token_id")
    if isinstance(eos_id, list):
        eos_id = eos_id[0] if eos_id else None
    return tok.id_to_token(int(eos_id)) if isinstance(eos_id, int) else None


def chat_template_of(root: pathlib.Path, tok_config: dict) -> str | None:
    """The chat template of a transformers directory: ``chat_template.jinja`` (the newer
    layout), else ``tokenizer_config.json``'s ``chat_template`` (its default, for a list)."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):      # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def hf_tokenizer_from(tok, source: str, vocab_size: int | None, *, eos: str | None,
                      bos: str | None = None, chat_template: str | None = None
                      ) -> BPETokenizer | ByteTokenizer:
    """A hyla tokenizer around a ``tokenizers.Tokenizer`` of a model (the checks of
    :func:`load_hf_tokenizer`, shared with the GGUF reader)."""
    from tokenizers import AddedToken

    n = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and n > vocab_size:
        raise ValueError(f"tokenizer mismatch: {source} has {n} tokens but the model has "
                         f"vocab_size={vocab_size}: expected a tokenizer with at most "
                         f"vocab_size ids")
    if _is_byte_map(tok):
        return ByteTokenizer()
    if eos is None or tok.token_to_id(eos) is None:
        eos = EOS if tok.token_to_id(EOS) is not None else None
    if eos is None:
        if vocab_size is not None and n >= vocab_size:
            raise ValueError(f"{source} names no end-of-text token (eos_token) it holds and "
                             f"the model's vocabulary ({vocab_size} ids) has no spare id for "
                             f"one: hyla needs an end-of-document token")
        tok.add_special_tokens([AddedToken(EOS, special=True)])
        eos = EOS
    if bos is not None and tok.token_to_id(bos) is None:
        bos = None
    return HFTokenizer(tok, eos, chat_template=chat_template, bos_token=bos)


def load_hf_tokenizer(root: pathlib.Path, vocab_size: int | None, *, required: bool = True
                      ) -> BPETokenizer | ByteTokenizer | None:
    """The tokenizer of a transformers directory, as a hyla tokenizer (see module docstring).
    ``vocab_size``: the model's (None: not checked). Without a ``tokenizer.json``: a
    ValueError, or None when not ``required`` (a checkpoint a trainer saved, a random-init
    config: transformers loads those too; what needs text says so, see
    :func:`hyla.model.load.require_tokenizer`)."""
    from tokenizers import Tokenizer

    root = pathlib.Path(root)
    path = root / "tokenizer.json"
    if not path.is_file() and (root / "tiktoken.model").is_file():
        return _load_tiktoken(root, vocab_size)
    if not path.is_file() and not required:
        log.warning("%s has no tokenizer.json: loaded without a tokenizer", root)
        return None
    if not path.is_file():
        raise ValueError(f"{root} has no tokenizer.json: expected a Hugging Face tokenizers file "
                         f"(a sentencepiece tokenizer.model alone is not supported)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exceptions for bad files
        raise ValueError(f"{path} is not a tokenizers JSON file: {e}") from e
    tok_config = _read_object(root / "tokenizer_config.json")
    eos = _token_text(tok_config.get("eos_token")) or _config_eos(root, tok)
    out = hf_tokenizer_from(tok, str(path), vocab_size, eos=eos,
                            bos=_token_text(tok_config.get("bos_token")),
                            chat_template=chat_template_of(root, tok_config))
    if isinstance(out, HFTokenizer):
        out.stop_ids = _end_ids(root, out.eos_id, tok.get_vocab_size(with_added_tokens=True))
    return out


def hf_form(tokenizer):
    """``tokenizer`` as a ``tokenizers`` file can hold it: Kimi's tiktoken one as an
    :class:`HFTokenizer` of the same ids, special tokens and chat template (what a
    checkpoint or an export writes, so that ``transformers`` reads it without Kimi's code);
    any other as it is."""
    if not isinstance(tokenizer, TiktokenTokenizer):
        return tokenizer
    out = HFTokenizer(tokenizer.to_tokenizers(), tokenizer.eos_token,
                      bos_token=tokenizer.bos_token, chat_template=tokenizer.chat_template)
    out.stop_ids = tokenizer.stop_ids
    return out


def _load_tiktoken(root: pathlib.Path, vocab_size: int | None):
    """Kimi's layout: ``tiktoken.model`` (:mod:`hyla.model.formats.hf.tiktoken_tokenizer`)."""
    tok_config = _read_object(root / "tokenizer_config.json")
    eos_id = _read_object(root / "config.json").get("eos_token_id")
    tok = load_tiktoken_tokenizer(root, vocab_size, config=tok_config,
                                  chat_template=chat_template_of(root, tok_config),
                                  config_eos_id=eos_id if isinstance(eos_id, int) else None)
    tok.stop_ids = _end_ids(root, tok.eos_id, tok.vocab_size)
    return tok


def _end_ids(root: pathlib.Path, eos_id: int | None, n: int) -> tuple[int, ...]:
    """Every other id that ends a generation: ``generation_config.json``'s and
    ``config.json``'s ``eos_token_id`` (a model may list several: Qwen's chat models end a
    turn with ``<|im_end|>`` or ``<|endoftext|>``), as transformers' ``generate`` stops."""
    ids = set()
    for name in ("generation_config.json", "config.json"):
        value = _read_object(root / name).get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n:
                ids.add(i)
    return tuple(sorted(ids - {eos_id}))


def save_hf_tokenizer(tokenizer: BPETokenizer | ByteTokenizer | None, out: pathlib.Path) -> dict:
    """Write ``tokenizer.json`` + ``tokenizer_config.json``; returns config.json token ids.
    A model loaded without a tokenizer (None) is written without one."""
    if tokenizer is None:
        return {}
    tokenizer = hf_form(tokenizer)
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
    if isinstance(tokenizer, HFTokenizer):
        config["bos_token"] = tokenizer.bos_token
        if tokenizer.chat_template:
            config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                               encoding="utf-8")
    return {"eos_token_id": eos_id}

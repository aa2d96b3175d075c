"""Kimi's tokenizer: a tiktoken BPE file (``tiktoken.model``), read with the ``tiktoken``
package, instead of a ``tokenizers`` JSON file.

Kimi Linear's checkpoints (and Kimi K2's) ship ``tiktoken.model`` (one ``base64(token) rank``
line per token), a ``tokenizer_config.json`` naming the special tokens by id
(``added_tokens_decoder``) and the chat template, and Python code (``tokenization_kimi.py``)
that ``transformers`` runs only with ``trust_remote_code``. hyla runs none of that code; what
it takes from it is written here: the pre-tokenising pattern, 256 special ids after the BPE
ranks (``<|reserved_token_{id}|>`` where the config names none), and splitting very long
texts before tiktoken sees them (its regex slows down on runs of tens of thousands of
characters without a break).

Example:
    >>> import base64, pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    >>> _ = (d / "tiktoken.model").write_text("\\n".join(lines) + "\\n")
    >>> tok = load_tiktoken_tokenizer(d, None)
    >>> tok.vocab_size, tok.decode(tok.encode("hi [EOS]")), tok.eos_token
    (512, 'hi [EOS]', '<|reserved_token_257|>')
"""

from __future__ import annotations

import json
import operator
import pathlib
import re

from hyla.model.formats.hf.chat_template import render_chat

FILE = "tiktoken.model"
# tokenization_kimi.py's pattern, alternative by alternative (``&&`` intersects classes)
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_SPECIAL = 256
# Kimi's limits: tiktoken takes at most 400K characters at once, and a run of more than 25K
# characters all whitespace or all not is cut (tiktoken's regex is slow on such runs)
MAX_CHARS = 400_000
MAX_RUN = 25_000
_RUNS = re.compile(r"\s+|\S+")


def _token_id(value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is a bool, not a token id")
    return operator.index(value)


def split_long(text: str) -> list[str]:
    """``text`` in pieces tiktoken encodes quickly, within Kimi's tokenizer's limits: at
    most ``MAX_CHARS`` characters, each run of whitespace or of other characters at most
    ``MAX_RUN`` long (a cut run's pieces are tokenised apart). Texts of up to ``MAX_RUN``
    characters stay whole, so their ids are tiktoken's own.

    Example:
        >>> [len(p) for p in split_long("a" * 60_000)]
        [25000, 25000, 10000]
    """
    if len(text) <= MAX_RUN:
        return [text]
    pieces, current = [], ""
    for run in _RUNS.findall(text):
        for i in range(0, len(run), MAX_RUN):
            part = run[i:i + MAX_RUN]
            if len(current) + len(part) > MAX_CHARS or (len(part) == MAX_RUN and current):
                pieces.append(current)
                current = ""
            current += part
            if len(part) == MAX_RUN:        # a cut run: the next part starts afresh
                pieces.append(current)
                current = ""
    return pieces + [current] if current else pieces


class TiktokenTokenizer:
    """A tiktoken ``Encoding`` with the interface of hyla's tokenizers (``encode``,
    ``decode``, ``eos_id``, ``stop_ids``, ``apply_chat_template``, ``save``). Special tokens
    written in a text are read as special tokens, as ``transformers`` reads its added
    tokens (a rendered chat template holds them). It saves as a ``tokenizer.json`` of the
    same ids (:meth:`save`)."""

    stop_ids: tuple[int, ...] = ()

    def __init__(self, ranks: dict[bytes, int], special: dict[str, int], eos_token: str, *,
                 bos_token: str | None = None, chat_template: str | None = None,
                 pattern: str = KIMI_PATTERN):
        import tiktoken

        self._enc = tiktoken.Encoding(name="hyla-tiktoken", pat_str=pattern,
                                      mergeable_ranks=ranks, special_tokens=special)
        self._ranks, self._special, self.pattern = ranks, special, pattern
        if eos_token not in special:
            raise ValueError(f"the end-of-text token {eos_token!r} is not a special token")
        self.eos_token, self.eos_id = eos_token, special[eos_token]
        self.bos_token = bos_token if bos_token in special else None
        self.bos_id = special.get(bos_token) if self.bos_token else None
        self.chat_template = chat_template or None
        # the longest text one token stands for (the server bounds prompts by it)
        self.max_token_bytes = max([len(t) for t in ranks] + [len(s.encode()) for s in special])

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids: list[int] = []
        for piece in split_long(text):
            ids += self._enc.encode(piece, allowed_special="all")
        return ids

    def decode(self, ids) -> str:
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"ids must be a sequence of ints, got {type(ids).__name__}")
        try:        # ints of any kind (numpy's, torch's 0-d), not floats or bools
            ids = [_token_id(i) for i in ids]
        except TypeError as e:
            raise ValueError(f"ids must be ints: {e}") from e
        bad = [i for i in ids if not 0 <= i < self._enc.n_vocab]
        if bad:
            raise ValueError(f"ids must be in [0, {self._enc.n_vocab}), got {bad[:5]}")
        return self._enc.decode(ids, errors="replace")

    def apply_chat_template(self, messages: list[dict], *, tokenize: bool = False,
                            add_generation_prompt: bool = True, **kwargs):
        """The prompt text (or ids, with ``tokenize``) of ``messages`` under the chat
        template; ValueError when the tokenizer has none."""
        text = render_chat(self, messages, add_generation_prompt, **kwargs)
        return self.encode(text) if tokenize else text

    def to_tokenizers(self):
        """The same tokenizer as a ``tokenizers.Tokenizer`` (``transformers``'
        ``TikTokenConverter``: the same ids), which ``transformers`` loads without Kimi's
        code."""
        import tempfile

        from tokenizers import AddedToken
        from transformers.convert_slow_tokenizer import TikTokenConverter

        with tempfile.TemporaryDirectory() as tmp:
            self.write_ranks(pathlib.Path(tmp) / FILE)
            tok = TikTokenConverter(vocab_file=str(pathlib.Path(tmp) / FILE),
                                    pattern=self.pattern).converted()
        # added here (the converter's keyword for them differs between versions): in id
        # order, so each takes the id it has here
        specials = sorted(self._special, key=self._special.__getitem__)
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
        if [tok.token_to_id(t) for t in specials] != [self._special[t] for t in specials]:
            raise ValueError("the converted tokenizer numbers the special tokens differently")
        return tok

    def save(self, path) -> None:
        """Write ``path`` (``tokenizer.json``: :meth:`to_tokenizers`) and a
        ``tokenizer_config.json`` beside it naming the special tokens and the chat template,
        the Hugging Face layout (``transformers`` reads it without Kimi's code)."""
        self.to_tokenizers().save(str(path))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token,
               "bos_token": self.bos_token}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        pathlib.Path(path).with_name("tokenizer_config.json").write_text(
            json.dumps(cfg, indent=2) + "\n", encoding="utf-8")

    def write_ranks(self, path: pathlib.Path) -> None:
        """Write the BPE ranks as a tiktoken file (``base64(token) rank`` lines)."""
        import base64

        lines = [f"{base64.b64encode(t).decode()} {r}"
                 for t, r in sorted(self._ranks.items(), key=lambda kv: kv[1])]
        pathlib.Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")

def read_ranks(path: pathlib.Path) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken file (``base64(token) rank`` a line), read here rather
    than by ``tiktoken.load``, which keeps a copy of any file it reads under a shared
    temporary folder keyed by the path and reuses it without looking at the file again (an
    edited or replaced file then loads as its first version). ValueError naming the file
    and the line when it is not one."""
    import base64
    import binascii

    try:
        lines = pathlib.Path(path).read_bytes().splitlines()
    except OSError as e:
        raise ValueError(f"{path} could not be read: {e}") from e
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError(f"{len(parts)} fields")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{path} is not a tiktoken BPE file (base64 token, space, rank on "
                             f"each line): line {number}: {e}") from e
        if not token:
            raise ValueError(f"{path} is not a tiktoken BPE file: line {number}'s token is "
                             f"empty")
        if token in ranks:
            raise ValueError(f"{path}: line {number} repeats a token")
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"{path} holds no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks must be 0 to {len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} single bytes (such as {missing[:3]}): "
                         f"a byte-level BPE must hold all 256, or some texts cannot be encoded")
    return ranks


def load_tiktoken_tokenizer(root: pathlib.Path, vocab_size: int | None, *,
                            config: dict | None = None, chat_template: str | None = None,
                            config_eos_id: int | None = None) -> TiktokenTokenizer:
    """The tokenizer of a directory holding ``tiktoken.model`` (Kimi's layout: see the
    module docstring). ``vocab_size``: the model's (None: not checked); ``config``: its
    ``tokenizer_config.json`` (read here when None); ``config_eos_id``: the EOS id
    ``config.json`` names, used where ``tokenizer_config.json`` names no EOS token."""
    root = pathlib.Path(root)
    if config is None:
        path = root / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    ranks = read_ranks(root / FILE)
    base = len(ranks)
    where = root / "tokenizer_config.json"
    by_id = {i: f"<|reserved_token_{i}|>" for i in range(base, base + NUM_SPECIAL)}
    named = config.get("added_tokens_decoder") or {}
    if not isinstance(named, dict):
        raise ValueError(f"{where}: added_tokens_decoder must be an object of id -> token")
    renamed: dict[str, int] = {}
    for key, value in sorted(named.items(), key=lambda kv: str(kv[0])):
        text = value.get("content") if isinstance(value, dict) else value
        if not (isinstance(key, str) and key.isdigit() and isinstance(text, str) and text):
            raise ValueError(f"{where}: added_tokens_decoder entry {key!r} is not an id with "
                             f"a token")
        token_id = int(key)
        if not base <= token_id < base + NUM_SPECIAL:
            raise ValueError(f"{where}: special token {text!r} has id {token_id}, outside the "
                             f"{NUM_SPECIAL} ids after the BPE's {base} "
                             f"([{base}, {base + NUM_SPECIAL}))")
        if text in renamed:
            raise ValueError(f"{where}: special token {text!r} is named for ids "
                             f"{renamed[text]} and {token_id}")
        renamed[text], by_id[token_id] = token_id, text
    special: dict[str, int] = {}
    for token_id, text in by_id.items():
        if text in special:     # a name given to one id and left as another's reserved name
            other = special[text] if renamed.get(text) == token_id else token_id
            raise ValueError(f"{where}: special token {text!r} (id {renamed[text]}) is also "
                             f"reserved id {other}'s name")
        special[text] = token_id
    n = base + NUM_SPECIAL
    if vocab_size is not None and n > vocab_size:
        raise ValueError(f"tokenizer mismatch: {root / FILE} has {n} tokens with its "
                         f"{NUM_SPECIAL} special ids but the model has vocab_size="
                         f"{vocab_size}: expected a tokenizer with at most vocab_size ids")

    def token_text(value):
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) and value in special else None

    # named by neither file: the id after the BPE's first special one, Kimi's [EOS]
    named_eos = config.get("eos_token")
    if named_eos is not None and token_text(named_eos) is None:
        raise ValueError(f"{where}: eos_token {named_eos!r} is not one of its special tokens")
    eos = (token_text(named_eos) or by_id.get(config_eos_id) or by_id[base + 1])
    return TiktokenTokenizer(ranks, special, eos, bos_token=token_text(config.get("bos_token")),
                             chat_template=chat_template)


"""A token's own bytes, for logprobs: byte-level vocabularies split an emoji or an accented
letter over several tokens, each of which decodes alone to U+FFFD. OpenAI's ``bytes`` field
and a distinct name for each such token need the bytes the token stands for, which the
tokenizer's decode loses; llguidance's tokenizer (already what structured output uses)
keeps them.

Example:
    >>> from hyla.data.tokenizer import ByteTokenizer
    >>> tok = ByteTokenizer()
    >>> token_bytes(tok, 0xF0), token_text(tok, 0xF0), token_text(tok, 104)
    (b'\\xf0', 'bytes:\\\\xf0', 'h')
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
# by id, the tokenizer kept with it (a server has one; any object serves as a key this way)
_BYTES: dict[int, tuple[object, object]] = {}


def _decoder(tok):
    """The tokenizer's ``ids -> bytes`` (llguidance's), or None where it cannot take it."""
    with _LOCK:
        if id(tok) in _BYTES:
            return _BYTES[id(tok)][1]
        try:
            import llguidance

            from hyla.serve.structured import tokenizers_json

            ll = llguidance.LLTokenizer(tokenizers_json(tok), n_vocab=tok.vocab_size)
            fn = ll.decode_bytes
        except Exception:  # noqa: BLE001 - another kind of tokenizer: its text's bytes
            fn = None
        _BYTES[id(tok)] = (tok, fn)
        return fn


def is_partial(text: str) -> bool:
    """Whether a token's decoded text lost bytes (U+FFFD: part of a character)."""
    return "\ufffd" in text


def token_bytes(tok, t: int, text: str | None = None) -> bytes:
    """Token ``t``'s bytes: its text's UTF-8, or, where that lost bytes, the vocabulary's."""
    text = tok.decode([t]) if text is None else text
    if is_partial(text):
        fn = _decoder(tok)
        if fn is not None:
            raw = fn([t])
            if raw and raw[0] != 0xFF:      # llguidance marks special tokens with 0xFF
                return raw
    return text.encode("utf-8", errors="surrogatepass")


def token_text(tok, t: int) -> str:
    """Token ``t``'s name in logprobs: its text, or, for part of a character, its bytes as
    OpenAI writes them (``bytes:\\xf0\\x9f``), so that alternatives stay apart."""
    text = tok.decode([t])
    if not is_partial(text):
        return text
    raw = token_bytes(tok, t, text)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

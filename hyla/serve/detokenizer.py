"""Incremental detokenisation with stop strings, for streaming text deltas."""

from __future__ import annotations


class IncrementalText:
    """Turns a growing list of output token ids into text deltas.

    A delta never ends inside what could still become a stop string (the last
    ``len(longest stop) - 1`` characters wait) or inside an unfinished UTF-8 character
    (a trailing U+FFFD waits). Once a stop string appears the text is cut before it and
    ``stopped`` is set.

    Example:
        >>> from hyla.data.tokenizer import ByteTokenizer
        >>> tok = ByteTokenizer(); t = IncrementalText(tok, ("\\n\\n",))
        >>> t.add(tok.encode("ab\\n")), t.add(tok.encode("ab\\n\\ncd")), t.stopped, t.flush()
        ('ab', '', True, '')
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, output_ids: list[int], hide_last: bool = False) -> str:
        """Decode ``output_ids`` (all so far; without the last when ``hide_last``: a stop
        token has no text) and return the new, safe-to-send text."""
        if self.stopped:
            return ""
        ids = output_ids[:-1] if hide_last else output_ids
        text = self.tokenizer.decode(ids)
        cut = min((i for i in (text.find(s, max(0, self.sent - len(s)))
                               for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        self.text = text
        end = len(text) if self.stopped else len(text) - self.holdback
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta

    def flush(self) -> str:
        """Whatever is still held back (call when the sequence finishes)."""
        delta, self.sent = self.text[self.sent:], len(self.text)
        return delta

"""OpenAI wire format: the chat template, response bodies and server-sent-event chunks.

A stream is a series of ``data: {json}\\n\\n`` events ending with ``data: [DONE]\\n\\n``.
Completion chunks carry ``choices[0].text`` (the last one also ``finish_reason``); chat
chunks carry ``choices[0].delta``: ``{"role": "assistant", "content": ""}`` first, then
``{"content": ...}``, then ``{}`` with ``finish_reason``. With
``stream_options.include_usage`` every chunk has ``"usage": null`` and one more chunk with
no choices carries the usage.
"""

from __future__ import annotations

import codecs
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hyla.serve.api.token_bytes import is_partial, token_bytes, token_text
from hyla.serve.api.tools import ToolStream, split_calls
from hyla.serve.engine import StepOutput

# The built-in chat template: each message is "<|role|>\n{content}\n", and the prompt ends
# with "<|assistant|>\n". Generation stops where the model starts a new turn.
CHAT_STOP = ("<|user|>", "<|system|>", "<|assistant|>")


def render_chat(tokenizer, messages: list[dict], **extra) -> tuple[str, tuple[str, ...]]:
    """The prompt text of ``messages`` (``[{"role", "content"}]``) and the stop strings the
    template implies. A tokenizer with its own ``chat_template`` (and
    ``apply_chat_template``, as transformers' have) uses it instead, with no extra stops,
    and the ``extra`` variables (``tools``).

    Example:
        >>> render_chat(None, [{"role": "user", "content": "Hi"}])[0]
        '<|user|>\\nHi\\n<|assistant|>\\n'
    """
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True, **extra), ()
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + "<|assistant|>\n", CHAT_STOP


def json_safe(obj):
    """``obj`` with every NaN and infinity replaced by None: JSON has no such numbers, and a
    model whose logits overflow (or whose weights were loaded with ``--allow-nonfinite``)
    must still answer valid JSON (``null`` for such a logprob).

    Example:
        >>> json_safe({"a": [float("nan"), -float("inf"), -0.5], "b": "x"})
        {'a': [None, None, -0.5], 'b': 'x'}
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


@dataclass
class Result:
    """One request's accumulated output."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list | None = None

    def add(self, out: StepOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens

    def usage(self) -> dict:
        p, c = self.num_prompt_tokens, self.num_output_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@dataclass
class Echo:
    """A completion's prompt, returned before its output (``echo: true``): its text, ids
    and, with ``logprobs``, the engine's prompt logprobs (None at the first token)."""

    text: str
    token_ids: list[int]


def _utf8_decoder():
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


class Formatter:
    """Builds the bodies and chunks of one request (``chat`` or completion).

    ``echo`` (completions): the prompt of each choice, in the order of the choices; its
    text leads the choice's text and, with ``logprobs``, its tokens lead the logprobs (the
    first with ``null``, the others with their log-probability and a ``top_logprobs`` dict
    holding the prompt token and the most likely ones, as vLLM and OpenAI return them).
    ``tools`` (chat): ``<tool_call>`` blocks in the output become ``message.tool_calls``
    (``delta.tool_calls`` when streamed) and the finish reason ``tool_calls``.
    """

    def __init__(self, tokenizer, request_id: str, model: str, chat: bool,
                 logprobs: int | None, include_usage: bool = False, text_offset: int = 0,
                 echo: list[Echo] | None = None, tools: bool = False):
        self.tok, self.id, self.model, self.chat = tokenizer, request_id, model, chat
        self.tools = tools and chat
        self.logprobs, self.include_usage = logprobs, include_usage
        self.created = int(time.time())
        self.offset = self._offset0 = text_offset   # completions' text_offset counts from here
        self._utf8 = _utf8_decoder()    # bytes of a character a later token completes
        self.echo = echo

    def _token(self, t: int) -> str:
        return token_text(self.tok, t)

    def _advance(self, t: int) -> int:
        """Token ``t``'s text offset; moves ``self.offset`` past the characters its bytes
        complete. The bytes of a character that a later token completes wait in
        ``self._utf8`` (an incremental decoder: a token may end, or begin, mid-character)."""
        at, text = self.offset, self.tok.decode([t])
        raw = token_bytes(self.tok, t, text) if is_partial(text) else text.encode(
            "utf-8", errors="surrogatepass")
        self.offset += len(self._utf8.decode(raw))
        return at

    def _prompt_entries(self, echo: Echo, plps: list | None) -> dict:
        """The completion logprobs of an echoed prompt (advances ``self.offset``)."""
        tokens, values, tops, offsets = [], [], [], []
        for i, t in enumerate(echo.token_ids):
            lp = plps[i] if plps is not None and i < len(plps) else None
            s = self._token(t)
            tokens.append(s)
            offsets.append(self._advance(t))
            values.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else
                        {s: lp.logprob} | {self._token(a): v for a, v in lp.top})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def format_logprobs(self, lps: list, echo: Echo | None = None,
                        prompt_logprobs: list | None = None) -> dict | None:
        if self.logprobs is None:
            return None
        if self.chat:
            def entry(t: int, lp: float) -> dict:
                return {"token": self._token(t), "logprob": lp,
                        "bytes": list(token_bytes(self.tok, t))}
            return {"content": [entry(x.token, x.logprob)
                                | {"top_logprobs": [entry(t, v) for t, v in x.top]}
                                for x in lps], "refusal": None}
        head = self._prompt_entries(echo, prompt_logprobs) if echo is not None else None
        tokens = [self._token(x.token) for x in lps]
        offsets = [self._advance(x.token) for x in lps]
        body = {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{self._token(t): v for t, v in x.top} for x in lps],
                "text_offset": offsets}
        return body if head is None else {k: head[k] + body[k] for k in body}

    def _envelope(self, choices: list, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}
        if self.chat:
            body["system_fingerprint"] = None
        return body

    def response(self, r: Result | list[Result]) -> dict:
        """The non-streaming body: one choice per Result (a batch of completion prompts),
        the usage summed over them."""
        results = r if isinstance(r, list) else [r]
        choices = []
        for i, res in enumerate(results):
            choice: dict = {"index": i}
            echo = self.echo[i] if self.echo else None
            finish = res.finish_reason
            if self.tools:
                content, calls = split_calls(res.text)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": res.text}
            else:
                choice["text"] = (echo.text if echo else "") + res.text
            self.offset, self._utf8 = self._offset0, _utf8_decoder()
            choice["logprobs"] = self.format_logprobs(res.logprobs, echo, res.prompt_logprobs)
            choice["finish_reason"] = finish
            choices.append(choice)
        p = sum(x.num_prompt_tokens for x in results)
        c = sum(x.num_output_tokens for x in results)
        return json_safe(self._envelope(choices, chunk=False) | {"usage": {
            "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})

    def _chunk(self, payload: dict, lps: list | None, finish: str | None) -> str:
        choice = {"index": 0} | payload
        choice["logprobs"] = self.format_logprobs(lps) if lps else None
        choice["finish_reason"] = finish
        return self._event(self._envelope([choice], chunk=True))

    def _event(self, body: dict) -> str:
        if self.include_usage:
            body.setdefault("usage", None)
        return f"data: {json.dumps(json_safe(body), ensure_ascii=False, allow_nan=False)}\n\n"

    async def stream(self, first: StepOutput, rest: AsyncIterator[StepOutput]
                     ) -> AsyncIterator[str]:
        """SSE events for ``first`` and the outputs after it, then usage and ``[DONE]``."""
        r = Result()
        if self.chat:
            yield self._chunk({"delta": {"role": "assistant", "content": ""}}, None, None)
        elif self.echo:                         # the prompt first, as vLLM streams it
            echo = self.echo[0]
            lps = (self.format_logprobs([], echo, first.prompt_logprobs)
                   if self.logprobs is not None else None)
            yield self._event(self._envelope([{"index": 0, "text": echo.text,
                                               "logprobs": lps, "finish_reason": None}],
                                              chunk=True))
        out: StepOutput | None = first
        calls = ToolStream() if self.tools else None
        while out is not None:
            r.add(out)
            finish = out.finish_reason if out.finished else None
            if calls is not None:
                for chunk in self._tool_chunks(calls, out.text, finish):
                    yield chunk
            elif self.chat:
                if out.text or (out.logprobs and self.logprobs is not None):
                    yield self._chunk({"delta": {"content": out.text}}, out.logprobs, None)
                if finish:
                    yield self._chunk({"delta": {}}, None, finish)
            elif out.text or finish or (out.logprobs and self.logprobs is not None):
                yield self._chunk({"text": out.text}, out.logprobs, finish)
            out = None if out.finished else await anext(rest, None)
        if self.include_usage:
            yield self._event(self._envelope([], chunk=True) | {"usage": r.usage()})
        yield "data: [DONE]\n\n"

    def _tool_chunks(self, calls: ToolStream, text: str, finish: str | None):
        """The chunks of one step's text under tools: content as it comes, each call once
        it closes (its id, name and empty arguments, then the arguments, as OpenAI streams
        them), the rest and the finish reason at the end."""
        for kind, _ in calls.feed(text):
            if kind == "content":
                yield self._chunk({"delta": {"content": _}}, None, None)
                continue
            k = len(calls.calls) - 1
            call = calls.calls[k]
            head = {"index": k, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            yield self._chunk({"delta": {"tool_calls": [head]}}, None, None)
            yield self._chunk({"delta": {"tool_calls": [{"index": k, "function": {
                "arguments": call["function"]["arguments"]}}]}}, None, None)
        if finish:
            rest = calls.flush()
            if rest:
                yield self._chunk({"delta": {"content": rest}}, None, None)
            reason = "tool_calls" if calls.calls and finish == "stop" else finish
            yield self._chunk({"delta": {}}, None, reason)

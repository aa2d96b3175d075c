"""Tool calling in the OpenAI shape, in the Hermes/Qwen format hyla's families write.

The model calls a tool by writing ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`` (Qwen2.5 and later, Qwen3-Next and Qwen3.5, Granite 4.0, Hermes), and reads a
result as a ``tool`` turn. A chat template that knows ``tools`` renders them itself; for one
that does not (SmolLM2's), the tools go into the system turn, calls into the assistant turn
and results into a user turn wrapped in ``<tool_response>``, as Qwen2.5's template writes
them. The grammar (:mod:`hyla.serve.structured`) makes every call valid JSON of the tool's
parameters: ``auto`` lets the model write text until it opens ``<tool_call>``; ``required``
and a named function allow calls only. Returned as ``message.tool_calls`` (``finish_reason:
"tool_calls"``) and streamed as ``delta.tool_calls`` (:class:`ToolStream`), as the
official ``openai`` client parses them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from hyla.serve.api.schemas import APIError
from hyla.serve.json_schema import closed, parse_schema
from hyla.serve.sequence import MAX_BUILT_GRAMMAR_CHARS, MAX_GRAMMAR_CHARS, GrammarSpec
from hyla.serve.structured import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
SYSTEM = ("You may call one or more functions to assist with the user query.\n\n"
          "You are provided with function signatures within <tools></tools> XML tags:\n"
          "<tools>\n{tools}\n</tools>\n\n"
          "For each function call, return a json object with function name and arguments "
          "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
          '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass
class Tools:
    """A request's validated tools and how it lets the model use them."""

    tools: list[dict]              # {"type": "function", "function": {...}}, as sent
    choice: str                    # "auto", "required", or the one function's name
    parallel: bool = True

    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def grammar(self) -> GrammarSpec:
        """What the output must match: calls only (``required``, a named function), or text
        with calls wherever ``<tool_call>`` opens (``auto``)."""
        chosen = [t for t in self.tools if self.choice in ("auto", "required")
                  or t["function"]["name"] == self.choice]
        # each tool's parameters under $defs, their own "#..." references re-rooted there,
        # so a Pydantic model's nested $defs (and a recursive "#") resolve inside them; JSON
        # as models write it, as response_format's (no free whitespace to fill)
        defs = {f"tool{i}": _rerooted(closed(t["function"].get("parameters") or {
            "type": "object", "properties": {}}), f"#/$defs/tool{i}")
            for i, t in enumerate(chosen)}
        call = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            "arguments": {"$ref": f"#/$defs/tool{i}"}}, "required": ["name", "arguments"],
            "additionalProperties": False} for i, t in enumerate(chosen)],
            "$defs": defs, "x-guidance": JSON_OPTIONS}
        body = json.dumps(call)
        if len(body) > MAX_BUILT_GRAMMAR_CHARS:
            raise APIError(f"tools: the tools' schemas together are too large ({len(body)} "
                           f"characters, at most {MAX_BUILT_GRAMMAR_CHARS}): send fewer",
                           param="tools")
        if self.choice == "auto":
            import llguidance

            tag = llguidance.StructTag(trigger=OPEN, begin=OPEN + "\n", grammar=call,
                                       end="\n" + CLOSE)
            # a dict grammar: to_grammar returns plain Lark
            return GrammarSpec("lark", llguidance.StructTag.to_grammar([tag],
                                                                        assume_special=False))
        many = "+" if self.parallel and self.choice == "required" else ""
        lark = (f'start: call{many}\ncall: "{OPEN}\\n" body "\\n{CLOSE}" "\\n"?\n'
                f"body: %json {body}\n")
        return GrammarSpec("lark", lark)


def _rerooted(schema, root: str):
    """``schema`` with its local references (``#``, ``#/...``) made relative to ``root``,
    where it is moved to."""
    if isinstance(schema, list):
        return [_rerooted(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rerooted(v, root) if k not in ("const", "enum", "default", "examples") else v
           for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def parse_tools(tools, tool_choice, parallel_tool_calls) -> Tools | None:
    """The request's tools, checked: APIError (400) naming the field for a tool that is
    not a function, a bad or duplicate name, parameters that are not a JSON schema object,
    or a ``tool_choice`` naming no tool. None when the model may not call any."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools: the request has none", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(f"tools must be a list of at most {MAX_TOOLS} tools", param="tools")
    seen = set()
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type") != "function" \
                or not isinstance(t.get("function"), dict):
            raise APIError(f'{where} must be {{"type": "function", "function": {{...}}}}',
                           param=where)
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', "
                           f"got {name!r}", param=f"{where}.function.name")
        if name in seen:
            raise APIError(f"{where}.function.name {name!r} is given twice: tool names must "
                           f"be unique", param=f"{where}.function.name")
        seen.add(name)
        params = f.get("parameters")
        if params is not None:
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                raise APIError(f"{where}.function.parameters must be a JSON schema of an "
                               f"object", param=f"{where}.function.parameters")
            text = json.dumps(params)
            if len(text) > MAX_GRAMMAR_CHARS:
                raise APIError(f"{where}.function.parameters is too large: {len(text)} "
                               f"characters, at most {MAX_GRAMMAR_CHARS}",
                               param=f"{where}.function.parameters")
            try:
                parse_schema(text)
            except ValueError as e:
                raise APIError(f"{where}.function.parameters: {e}",
                               param=f"{where}.function.parameters") from None
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in seen:
            raise APIError(f"tool_choice names no tool of the request ({sorted(seen)}): got "
                           f"{json.dumps(choice)[:200]}", param="tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise APIError(f"tool_choice must be 'none', 'auto', 'required' or "
                       f'{{"type": "function", "function": {{"name": ...}}}}, got '
                       f"{json.dumps(choice)[:200]}", param="tool_choice")
    if choice == "none":
        return None
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise APIError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    return Tools(tools, choice, parallel_tool_calls is not False)


def chat_messages(messages, tools: Tools | None, template: str | None) -> tuple[list, dict]:
    """The request's messages as a chat template takes them, and the extra variables it
    renders with (``tools`` where the template knows them). Where it does not, the tools,
    calls and results are written into the turns as text (Qwen2.5's format)."""
    native = bool(template) and "tools" in template
    out = []
    for m in messages:
        entry = {"role": m.role, "content": m.text}
        if m.role == "assistant" and m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                     for c in m.tool_calls]
            if native:
                entry["tool_calls"] = [{"id": c.id, "type": "function", "function": call}
                                       for c, call in zip(m.tool_calls, calls, strict=True)]
            else:
                entry["content"] = "\n".join(
                    ([m.text] if m.text else [])
                    + [f"{OPEN}\n{json.dumps(c, ensure_ascii=False)}\n{CLOSE}" for c in calls])
        elif m.role == "tool":
            if native:
                entry["tool_call_id"] = m.tool_call_id
            else:
                entry = {"role": "user",
                         "content": f"<tool_response>\n{m.text}\n</tool_response>"}
        out.append(entry)
    if tools is None:
        return out, {}
    if native:
        return out, {"tools": tools.tools}
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools)
    system = SYSTEM.format(tools=listing)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


def _arguments(text: str):
    """A call's arguments as the template wants them: the object its JSON text holds."""
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return text


def new_call(body: str) -> dict | None:
    """An OpenAI tool call from the JSON a ``<tool_call>`` block holds (None if it is not
    ``{"name": str, "arguments": object}``)."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"],
                         "arguments": json.dumps(args, ensure_ascii=False)}}


def _inside_string(json_text: str) -> bool:
    """Whether ``json_text`` ends inside a JSON string."""
    inside = escaped = False
    for ch in json_text:
        if escaped:
            escaped = False
        elif ch == "\\" and inside:
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside


def block_end(text: str, start: int) -> int:
    """Where the ``</tool_call>`` that ends the block opened at ``start`` begins (-1: not
    yet written). One inside a JSON string is an argument's text, not the end (a call
    whose argument holds the tag was once cut there and lost)."""
    body = start + len(OPEN)
    end = text.find(CLOSE, body)
    while end >= 0 and _inside_string(text[body:end]):
        end = text.find(CLOSE, end + 1)
    return end


def split_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the text outside ``<tool_call>`` blocks, or None when empty; the calls).

    Example:
        >>> content, calls = split_calls('Sure.\\n<tool_call>\\n{"name": "f", '
        ...                              '"arguments": {"x": 1}}\\n</tool_call>')
        >>> content, calls[0]["function"]
        ('Sure.', {'name': 'f', 'arguments': '{"x": 1}'})
    """
    calls, kept, last, at = [], [], 0, 0
    while (start := text.find(OPEN, at)) >= 0 and (end := block_end(text, start)) >= 0:
        at = end + len(CLOSE)
        call = new_call(text[start + len(OPEN):end].strip())
        if call is None:
            continue
        kept.append(text[last:start])
        last = at
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None), calls


class ToolStream:
    """Streamed text -> content pieces and whole tool calls: text that may be the start of
    ``<tool_call>`` is held back until it is known not to be; a block is held until it
    closes, then comes out as one call.

    Example:
        >>> s = ToolStream()
        >>> s.feed("Hi <tool") + s.feed('_call>\\n{"name": "f", "arguments": {}}\\n</tool_call>')
        [('content', 'Hi '), ('call', 'f')]
    """

    def __init__(self):
        self._buf = ""
        self.calls: list[dict] = []
        # after a call, the newlines that follow it are not content (split_calls drops them
        # too); they may come in a later piece than the call's closing tag
        self._after_call = False

    def feed(self, text: str) -> list[tuple[str, object]]:
        """Events ``("content", str)`` and ``("call", name)`` (the call in :attr:`calls`)."""
        self._buf += text
        if self._after_call:
            self._buf = self._buf.lstrip("\n")
            self._after_call = not self._buf
        events = []
        while self._buf:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, OPEN)
                piece, self._buf = self._buf[:len(self._buf) - keep], self._buf[
                    len(self._buf) - keep:]
                if piece:
                    events.append(("content", piece))
                break
            if start:
                events.append(("content", self._buf[:start]))
                self._buf = self._buf[start:]
            end = block_end(self._buf, 0)
            if end < 0:
                break
            call = new_call(self._buf[len(OPEN):end].strip())
            if call is None:
                events.append(("content", self._buf[:end + len(CLOSE)]))
            else:
                self.calls.append(call)
                events.append(("call", call["function"]["name"]))
            self._buf = self._buf[end + len(CLOSE):].lstrip("\n") if call else \
                self._buf[end + len(CLOSE):]
            self._after_call = call is not None and not self._buf
        return events

    def flush(self) -> str:
        """What is left (an unclosed block, a held-back ``<tool``): it was text after all."""
        rest, self._buf = self._buf, ""
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

"""Chat templates as ``transformers`` renders them: Jinja, sandboxed (a template from the hub
is untrusted code), with the helpers templates call (``raise_exception``, ``tojson``,
``strftime_now``) and loop controls.

Example:
    >>> chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").render(
    ...     messages=[{"role": "user", "content": "hi"}])
    'hi'
"""

from __future__ import annotations

import datetime
import functools
import json


@functools.lru_cache(maxsize=8)
def chat_template(source: str):
    # Chat templates from the hub are untrusted code: a sandboxed environment, as
    # transformers uses, with the helpers its templates call.
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                **kwargs) -> str:
    """The prompt text of ``messages`` under ``tokenizer``'s ``chat_template``, with its
    ``bos_token`` and ``eos_token``, as ``transformers`` renders it; ValueError when the
    tokenizer has none."""
    if not tokenizer.chat_template:
        raise ValueError("this tokenizer has no chat_template")
    return chat_template(tokenizer.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token, **kwargs)

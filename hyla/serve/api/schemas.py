"""Request bodies of the OpenAI-compatible API (pydantic, strict types) and error bodies.

Types are strict, as OpenAI's are: ``"max_tokens": "5"`` is a 400, not a 5. Fields OpenAI
defines that hyla does not implement are accepted only at their neutral value (``n`` 1,
no ``logit_bias``, no ``suffix``, no legacy ``functions``/``function_call``) and are a 400
otherwise; unknown fields are ignored. ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``repetition_penalty``, ``structured_outputs`` and ``guided_*`` are extensions (vLLM's names);
the ``openai`` client sends them through ``extra_body``. Structured output and tools:
:mod:`hyla.serve.api.response_format`, :mod:`hyla.serve.api.tools`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error the API returns as ``{"error": {...}}`` with HTTP ``status``.

    Example:
        >>> APIError("bad n", param="n").body()["error"]["type"]
        'invalid_request_error'
    """

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type
        self.code, self.headers = code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Fields hyla does not implement -> (their neutral values, what to say). A request with
# any other value is a 400 naming the field.
NEUTRAL = {
    "functions": ((None, []), "the legacy function calling is not supported (use tools)"),
    "function_call": ((None, "none"), "the legacy function calling is not supported (use "
                                      "tool_choice)"),
}


def check_neutral(req) -> None:
    """APIError (400) naming the first field of :data:`NEUTRAL` that ``req`` sets to a value
    other than its neutral ones.

    Example:
        >>> class R: functions, function_call = [{"name": "f"}], None
        >>> try:
        ...     check_neutral(R())
        ... except APIError as e:
        ...     print(e.status, e.param)
        400 functions
    """
    for name, (neutral, why) in NEUTRAL.items():
        value = getattr(req, name, None)
        if not any(value == v for v in neutral):
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise APIError(f"{name} is not supported: {why} by this server; send it "
                           f"unset (or {neutral[1]!r}), got {shown}", param=name,
                           code="unsupported_parameter")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields common to completions and chat."""

    model: str | None = None          # None: the one model served
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # structured output (hyla.serve.api.response_format): checked there, any shape here
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # tools (chat only; hyla.serve.api.tools); the legacy functions are refused
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None

    def check_unsupported(self) -> None:
        """Raise APIError for a field hyla accepts only at its neutral value."""
        check_neutral(self)
        if self.n != 1:
            raise APIError(f"n must be 1 (one choice per request), got {self.n}", param="n")
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true",
                           param="stream_options")

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


MAX_BATCH_PROMPTS = 256      # prompts one completion request may carry


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: text, token ids, or a list of either (a batch:
    one choice per prompt, in order; not with ``stream``). ``echo``: the prompt leads the
    choice's text and, with ``logprobs``, its tokens' log-probabilities lead the logprobs;
    ``max_tokens: 0`` (only with ``echo``) scores the prompt alone."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(f"best_of must be 1, got {self.best_of}", param="best_of")
        if self.tools or self.tool_choice not in (None, "none"):
            raise APIError("tools are for chat completions (/v1/chat/completions)",
                           param="tools" if self.tools else "tool_choice")
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise APIError(f"logprobs must be between 0 and 5, got {self.logprobs}",
                           param="logprobs")
        n = len(self.prompts)
        if n > MAX_BATCH_PROMPTS:
            raise APIError(f"at most {MAX_BATCH_PROMPTS} prompts a request, got {n}",
                           param="prompt")
        if n > 1 and self.stream:
            raise APIError(f"stream is not supported with several prompts ({n}): send one "
                           "request per prompt", param="stream")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or the batch's (each text or token ids)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)
        return [p]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None        # assistant turns
    tool_call_id: str | None = None                 # tool turns: the call they answer

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. ``max_tokens`` (or ``max_completion_tokens``)
    defaults to the rest of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= 20:
                raise APIError(f"top_logprobs must be between 0 and 20, got "
                               f"{self.top_logprobs}", param="top_logprobs")

"""vLLM's tokenizer routes, which lm-evaluation-harness's ``local-completions`` model uses
(its ``remote`` tokenizer backend, auto-detected): the harness then tokenizes with the
server's own tokenizer and sends token ids, with no tokenizer download.

- ``POST /tokenize`` ``{"prompt": str, "add_special_tokens": bool}`` ->
  ``{"tokens": [ids], "count": n, "max_model_len": L}``;
- ``POST /detokenize`` ``{"tokens": [ids]}`` -> ``{"prompt": str}``;
- ``GET /tokenizer_info`` -> ``{"eos_token", "bos_token", "pad_token", "chat_template",
  "tokenizer_class", "model_max_length"}``.

Example:
    >>> from fastapi import FastAPI
    >>> from fastapi.testclient import TestClient
    >>> from hyla.data.tokenizer import ByteTokenizer
    >>> app = FastAPI()
    >>> add_tokenizer_routes(app, ByteTokenizer(), 64)
    >>> c = TestClient(app)
    >>> c.post("/tokenize", json={"prompt": "hi"}).json()
    {'tokens': [104, 105], 'count': 2, 'max_model_len': 64}
    >>> c.post("/detokenize", json={"tokens": [104, 105]}).json()
    {'prompt': 'hi'}
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from hyla.serve.api.limits import utf8_bytes
from hyla.serve.api.schemas import APIError


def encode_plain(tok, text: str, add_special_tokens: bool = False) -> list[int]:
    """``text``'s token ids without the BOS a tokenizer adds by itself (unless
    ``add_special_tokens``): what a harness concatenates (context, then continuation).

    Example:
        >>> from hyla.data.tokenizer import ByteTokenizer
        >>> encode_plain(ByteTokenizer(), "ab")
        [97, 98]
    """
    ids = tok.encode(text)
    bos, bos_text = getattr(tok, "bos_id", None), getattr(tok, "bos_token", None)
    if (not add_special_tokens and bos is not None and ids and ids[0] == bos
            and not (bos_text and text.startswith(bos_text))):
        ids = ids[1:]
    return ids


def tokenizer_info(tok, max_len: int) -> dict:
    """What ``GET /tokenizer_info`` answers for ``tok``."""
    return {"eos_token": getattr(tok, "eos_token", None),
            "bos_token": getattr(tok, "bos_token", None), "pad_token": None,
            "chat_template": getattr(tok, "chat_template", None),
            "tokenizer_class": type(tok).__name__, "model_max_length": max_len}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenizeRequest(_Strict):
    prompt: str
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(_Strict):
    tokens: list[int]
    model: str | None = None


def add_tokenizer_routes(app: FastAPI, tok, max_len: int) -> None:
    """Add ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` for ``tok`` to ``app``
    (tokenizing runs off the event loop; a token-only server answers 400)."""

    def need() -> None:
        if tok is None:
            raise APIError("this server has no tokenizer (token ids only)")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        need()
        utf8_bytes(req.prompt, "prompt")
        ids = await asyncio.to_thread(encode_plain, tok, req.prompt, req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        need()
        vocab = tok.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(f"tokens must be ids in [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, req.tokens)}

    @app.get("/tokenizer_info")
    async def info():
        need()
        return tokenizer_info(tok, max_len)

"""The OpenAI-compatible HTTP API (FastAPI): :mod:`.app` (the routes, ``create_app``),
:mod:`.schemas` (request bodies, strictly typed, and error bodies), :mod:`.format` (chat
templates, responses and server-sent events), :mod:`.limits` (what keeps one request from
hurting the server) and :mod:`.tokens` (vLLM's tokenizer routes, which lm-eval uses).
Importing the package imports none of them: the server's other modules use the schemas
without the app."""

"""``hyla chat``: an interactive chat in the terminal, tokens streamed as they come.

The conversation's state (a hybrid's constant-size linear states, and the attention layers'
KV rows) is kept between turns: each turn feeds the model only the tokens that are new since
the last (the closing of the previous reply, the next user message, the template's opening of
the reply), never the history again. When the chat template renders the history differently
from what was fed (a template that trims replies, say), the turn re-reads the conversation
from the start, and says so.

``/reset`` starts a new conversation, ``/exit`` (or Ctrl-D) ends it; Ctrl-C stops a reply.

Example:
    $ hyla chat --checkpoint smollm2
    $ echo "What is the capital of France?" | hyla chat --checkpoint smollm2 --temperature 0
"""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console

from hyla.cli.common import (
    PRESETS_HELP,
    SOURCE_HELP,
    add_sampling,
    add_speculative,
    check_sampling,
    format_bytes,
    random_model,
    stop_ids,
    torch_threads,
)
from hyla.cli.model_flags import (
    add_quantize,
    add_weights_cache,
    apply_quantize,
    drafter,
    drafts_kept,
    load_quantized,
)


def add_chat(sub) -> argparse.ArgumentParser:
    """Register ``hyla chat`` on the ``hyla`` sub-parser set."""
    p = sub.add_parser("chat", help="chat with a model in the terminal (keeps the "
                                    "conversation's state between turns)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", default=None, help=SOURCE_HELP)
    src.add_argument("--preset", default=None,
                     help=f"random weights of this preset ({PRESETS_HELP}; testing)")
    p.add_argument("--system", default=None,
                   help="a system message that opens the conversation (default: none)")
    add_sampling(p, 256, None, temperature=0.7, top_p=0.9)
    add_speculative(p, "with --temperature 0, without --json-schema")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="every reply is JSON that this JSON schema (a file) accepts: "
                        "grammar-constrained decoding (default: free text)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    add_quantize(p)
    add_weights_cache(p)
    p.set_defaults(func=cmd_chat)
    return p


COMMANDS = {"chat": add_chat}


class Conversation:
    """A chat whose model state is kept between turns.

    ``reply(text)`` yields the reply's text as it is generated; afterwards ``last`` holds
    the turn's figures (tokens fed, tokens generated, seconds, re-read or not).

    Example:
        >>> from hyla.cli.common import random_model
        >>> model, tok = random_model("debug", 0)
        >>> chat = Conversation(model, tok, max_tokens=4, temperature=0)
        >>> _ = "".join(chat.reply("Hi")); first = chat.last["fed"]
        >>> _ = "".join(chat.reply("And?")); chat.last["reread"], chat.last["fed"] < first + 8
        (False, True)
    """

    def __init__(self, model, tok, *, system: str | None = None, max_tokens: int = 256,
                 temperature: float = 0.7, top_k: int | None = None, top_p: float = 1.0,
                 seed: int = 0, json_schema: dict | None = None, drafter=None):
        import json

        import torch

        from hyla.serve.api.format import render_chat
        from hyla.serve.sequence import GrammarSpec
        from hyla.serve.structured import GrammarCompiler

        self.model, self.tok, self.system = model, tok, system
        self.sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        self.max_tokens = max_tokens
        self.generator = torch.Generator(device=model.anchor.device).manual_seed(seed)
        self._render = render_chat
        self.stop_ids = stop_ids(tok)
        self.drafter = drafter          # speculative decoding (greedy replies)
        # json_schema: each reply's grammar (ValueError now if the schema is bad)
        self.grammar = None
        if json_schema is not None:
            spec = GrammarSpec("json_schema", json.dumps(json_schema))
            compiler = GrammarCompiler(tok, model.cfg.vocab_size, self.stop_ids)
            compiler.compile(spec)
            self.grammar = (compiler, spec)
        self.last: dict = {}
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (a fresh state)."""
        self.messages = [] if self.system is None else [{"role": "system",
                                                         "content": self.system}]
        self.state = None        # built on the first turn
        self.rendered = ""       # the text the state has read (and the pending token's)
        self.pending: list[int] = []   # sampled last, not yet fed
        self.read: list[int] = []      # the ids the state has read (what drafters look at)

    def reply(self, text: str):
        """Add the user's ``text`` and yield the reply's text in pieces as it comes."""
        from hyla.model.stream import StreamTiming, stream_tokens
        from hyla.serve.detokenizer import IncrementalText
        from hyla.serve.session import RunnerState
        from hyla.serve.structured import TokenConstraint

        self.messages.append({"role": "user", "content": text})
        prompt, stops = self._render(self.tok, self.messages)
        reread = self.state is None or not prompt.startswith(self.rendered)
        if reread:
            self.state, self.pending, self.read = RunnerState(self.model), [], []
            new_ids = self.tok.encode(prompt)
        else:
            new_ids = self.pending + self._encode_more(prompt[len(self.rendered):])
        history = self.state.num_tokens
        timing, ids = StreamTiming(), []
        detok = IncrementalText(self.tok, stops)
        start = time.perf_counter()
        try:
            for token in stream_tokens(self.model, self.state, new_ids, self.max_tokens,
                                       generator=self.generator, stop_ids=self.stop_ids,
                                       timing=timing, **self.sampling,
                                       constraint=self.grammar and TokenConstraint(
                                           *self.grammar), drafter=self.drafter,
                                       context=self.read):
                ids.append(token)
                piece = detok.add(ids)
                if piece:
                    yield piece
                if detok.stopped:
                    break
            yield detok.flush()
        except BaseException:
            # A reply cut short (Ctrl-C) leaves the state mid-step: re-read next turn.
            self.state = None
            raise
        finally:
            answer = detok.text
            self.messages.append({"role": "assistant", "content": answer})
            self.last = {"history": history, "fed": len(new_ids), "new": len(ids),
                         "new_ids": new_ids, "ids": ids,
                         "reread": reread, "seconds": time.perf_counter() - start,
                         "timing": timing}
        if detok.stopped:
            # a stop string cut the text: what the state read no longer matches the reply
            self.state = None
        else:
            # the state read the prompt and the reply but its last token, kept pending; a
            # stop token was not fed, and the template's closing of the reply is next turn's
            self.pending = [] if timing.stopped or not ids else [ids[-1]]
            self.read = self.read + new_ids + ids[:len(ids) - len(self.pending)]
            self.rendered = prompt + self.tok.decode(ids)

    def _encode_more(self, text: str) -> list[int]:
        """The ids of text that continues a conversation: without the BOS a tokenizer's
        post-processor would put in front of a whole prompt."""
        if not text:
            return []
        ids = self.tok.encode(text)
        bos = getattr(self.tok, "bos_id", None)
        if ids and bos is not None and ids[0] == bos and \
                not text.startswith(getattr(self.tok, "bos_token", None) or "\0"):
            ids = ids[1:]
        return ids


def cmd_chat(args: argparse.Namespace, out: Console) -> int:
    import torch

    check_sampling(args)
    schema = read_schema(args.json_schema) if args.json_schema is not None else None
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    if args.checkpoint is not None:
        from hyla.model.load import load_model, model_name, require_tokenizer

        def load():
            with torch_threads(args.threads):
                model, tok = load_model(args.checkpoint, device=device)
            return model, require_tokenizer(tok, args.checkpoint, "hyla chat")
        model, tok, _ = load_quantized(args, err, load, device=device)
        name = model_name(args.checkpoint)
    else:
        model, tok = random_model(args.preset, args.seed)
        model, name = model.to(device), f"hyla-{args.preset} (random weights: noise)"
        apply_quantize(model, args, err)
    err.print(f"[bold]{name}[/] loaded in {time.perf_counter() - start:.1f} s. "
              f"{state_note(model)}")
    err.print("[dim]/reset starts over, /exit or Ctrl-D ends, Ctrl-C stops a reply[/]")
    draft = drafter(args, model, tok, err)
    try:
        chat = Conversation(model, tok, system=args.system, max_tokens=args.max_tokens,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, json_schema=schema, drafter=draft)
    except ValueError as e:
        raise ValueError(f"--json-schema {args.json_schema}: {e}") from None
    tty = sys.stdin.isatty()
    with torch_threads(args.threads):
        while True:
            try:
                line = input(">>> ") if tty else sys.stdin.readline()
            except EOFError:     # Ctrl-D
                break
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                continue
            if not tty and not line:     # the end of piped input
                break
            text = line.strip()
            if text in ("/exit", "/quit", "/bye"):
                break
            if text == "/reset":
                chat.reset()
                err.print("[dim](new conversation)[/]")
                continue
            if not text:
                continue
            try:
                for piece in chat.reply(text):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                err.print("[dim](stopped)[/]")
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            err.print(f"[dim]{turn_line(chat.last)}{drafts_kept(args, draft)}[/]")
    return 0


def read_schema(path: str):
    """``--json-schema``'s file as JSON, read before the model loads: at most the 64 KiB a
    schema may hold (so ``/dev/zero`` is refused, not read), UTF-8 with or without a BOM."""
    import json

    from hyla.serve.sequence import MAX_GRAMMAR_CHARS, GrammarSpec
    from hyla.serve.structured import check_grammar

    try:
        with open(path, "rb") as f:
            raw = f.read(4 * MAX_GRAMMAR_CHARS + 1)
        if len(raw) > 4 * MAX_GRAMMAR_CHARS:
            raise ValueError(f"larger than {4 * MAX_GRAMMAR_CHARS} bytes: a schema holds at "
                             f"most {MAX_GRAMMAR_CHARS} characters")
        schema = json.loads(raw.decode("utf-8-sig"))
        # what the grammar makes of it, now: a bad schema once failed after the model had
        # loaded and the user had typed
        check_grammar(GrammarSpec("json_schema", json.dumps(schema)))
        return schema
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        what = "nested too deeply" if isinstance(e, RecursionError) else e
        raise ValueError(f"--json-schema {path}: {what}") from None


def turn_line(last: dict) -> str:
    """The figures shown after a reply.

    Example:
        >>> from hyla.model.stream import StreamTiming
        >>> t = StreamTiming(prompt_tokens=9, prompt_s=0.3, new_tokens=21, decode_s=2.0)
        >>> turn_line({"history": 120, "fed": 9, "new": 21, "reread": False, "timing": t})
        '21 tokens at 10.0 tok/s; read 9 new tokens at 30 tok/s (120 kept from earlier turns)'
    """
    t = last["timing"]
    rate = t.decode_tok_s
    head = f"{last['new']} tokens" + (f" at {rate:.1f} tok/s" if rate == rate else "")
    fed = t.prompt_tok_s
    read = f"read {last['fed']} new tokens" + (f" at {fed:.0f} tok/s" if fed == fed else "")
    if last["reread"] and last["history"] == 0 and last["fed"]:
        return f"{head}; {read}"
    if last["reread"]:
        return f"{head}; {read} (the template changed the history: read again)"
    return f"{head}; {read} ({last['history']} kept from earlier turns)"


def state_note(model) -> str:
    """What the model keeps between turns, in words."""
    dtype = model.anchor.dtype
    specs = model.state_specs
    fixed = sum(s.fixed_bytes(dtype) for s in specs)
    per_token = sum(s.per_token_bytes(dtype) for s in specs)
    if not fixed and not per_token:
        return ""
    parts = []
    if fixed:
        parts.append(f"{format_bytes(fixed)} of constant-size state "
                     f"({sum(1 for s in specs if s.fixed and not s.per_token)} linear layers)")
    if per_token:
        n = sum(1 for s in specs if s.per_token)
        parts.append(f"{format_bytes(per_token)} a token of KV ({n} attention layers)")
    return ("Kept between turns, so each turn reads only its new tokens: "
            + " + ".join(parts) + ".")

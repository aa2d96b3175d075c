"""EleutherAI's lm-evaluation-harness in process: the ``hyla`` LM (the ``eval`` extra).

:class:`HylaEvalLM` is registered in ``lm-eval`` as ``hyla`` (``lm_eval --model hyla
--model_args checkpoint=SOURCE``), any :func:`~hyla.model.load_model` source:

- ``loglikelihood`` (and multiple choice): requests sorted by length and packed, ``batch_size``
  at a time, into one row with ``cu_seqlens`` (hyla's one forward, no padding); logits only at
  the continuation's rows, so no ``[tokens, vocab]`` matrix is built;
- ``loglikelihood_rolling``: the harness's disjoint windows of ``max_length``, scored alike;
- ``generate_until``: through the serving engine (continuous batching, stop strings).

Tokens are the model's tokenizer's, without the BOS it may add by itself (the harness
concatenates context and continuation ids), as ``hyla serve``'s ``/tokenize`` gives them to
``lm-eval``'s ``local-completions``: both paths score the same ids.

:func:`run_harness` is ``hyla eval harness``: tasks by name (``lm-eval``'s own, or YAML files
under ``include_path``), results as ``lm-eval`` writes them plus its table.
"""

from __future__ import annotations

import functools
import json
import pathlib

import torch

try:
    # lm-eval's own models first: they register lazily on this import, which registering
    # ours before it would otherwise hide (local-completions, hf, ...)
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - the eval extra is missing
    raise ImportError("hyla.eval.harness needs lm-evaluation-harness: "
                      "pip install 'hyla[eval]'") from e

from hyla.serve.api.tokens import encode_plain


@register_model("hyla")
class HylaEvalLM(TemplateLM):
    """An ``lm-eval`` LM over a HylaLM and its tokenizer.

    Args:
        checkpoint: a :func:`~hyla.model.load_model` source (or pass ``model`` and
            ``tokenizer``).
        batch_size: requests a forward (log-likelihoods) and sequences decoded together.
        max_length: longest input (default 2048); longer inputs are
            cut on the left, as the harness's own models do.
        max_gen_toks: default generation length when a task names none.

    Example:
        >>> from hyla.model import HylaLM, preset
        >>> from hyla.data import ByteTokenizer
        >>> lm = HylaEvalLM(model=HylaLM(preset("debug")), tokenizer=ByteTokenizer())
        >>> (lp, greedy), = lm._loglikelihood_tokens([(None, [104, 105], [33])])
        >>> lp < 0, isinstance(greedy, bool)
        (True, True)
    """

    def __init__(self, checkpoint: str | None = None, *, model=None, tokenizer=None,
                 batch_size: int | str = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, device: str | None = None, **_ignored):
        super().__init__()
        if model is None:
            if checkpoint is None:
                raise ValueError("HylaEvalLM needs checkpoint=SOURCE (or model and tokenizer)")
            from hyla.model.load import load_model, require_tokenizer

            model, tokenizer = load_model(checkpoint)
            require_tokenizer(tokenizer, checkpoint, "hyla eval harness")
        if tokenizer is None:
            raise ValueError("HylaEvalLM needs the model's tokenizer")
        if device:
            model = model.to(device)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_length = int(max_length or 2048)
        self.max_gen_toks = int(max_gen_toks)
        self._device = next(model.parameters()).device
        self._engine = None

    # -- tokens ------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_id", None)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: BOS, else EOS, else token 0."""
        for t in (getattr(self.tokenizer, "bos_id", None), self.eot_token_id):
            if t is not None:
                return t
        return 0

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        return encode_plain(self.tokenizer, string, bool(add_special_tokens))

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    # -- scoring -----------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether greedy decoding gives it) per
        ``(key, context ids, continuation ids)``."""
        order = sorted(range(len(requests)),
                       key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for a in range(0, len(order), self.batch_size):
            batch = order[a:a + self.batch_size]
            rows = [self._input(requests[i][1], requests[i][2]) for i in batch]
            for i, res in zip(batch, self._score(rows), strict=True):
                out[i] = res
        return out  # type: ignore[return-value]

    def _input(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """(model input, continuation): the last ``max_length`` tokens but the final one."""
        if not continuation:
            raise ValueError("a continuation must hold at least one token")
        whole = (context + continuation)[-(self.max_length + 1):]
        return whole[:-1], continuation

    def _score(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        ids = torch.tensor([t for inp, _ in rows for t in inp], device=self._device)
        lens = torch.tensor([len(inp) for inp, _ in rows])
        cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        hidden = self.model(ids[None], cu_seqlens=cu.to(self._device), hidden=True)[0]
        results = []
        for j, (_, cont) in enumerate(rows):
            end = int(cu[j + 1])
            at = hidden[end - len(cont):end]            # the rows that predict cont
            lp = torch.log_softmax(self.model.lm_head(at).float(), dim=-1)
            target = torch.tensor(cont, device=self._device)
            total = float(lp.gather(1, target[:, None]).sum())
            results.append((total, bool((lp.argmax(-1) == target).all())))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for (text,) in (r.args for r in requests):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, c, x) for c, x in windows])
            total = sum(s for s, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    # -- generation --------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from hyla.serve.engine import Engine, EngineConfig
        from hyla.serve.sequence import SamplingParams

        prompts, params, stops = [], [], []
        for context, kw in (r.args for r in requests):
            kw = dict(kw)
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            n = int(kw.pop("max_gen_toks", kw.pop("max_tokens", self.max_gen_toks)))
            sample = bool(kw.pop("do_sample", False))
            temp = float(kw.pop("temperature", 0.0)) if sample else 0.0
            ids = self.tok_encode(context)[-max(1, self.max_length - n):]
            prompts.append(ids)
            stops.append(until)
            params.append(SamplingParams(max_tokens=n, temperature=temp, stop=tuple(until),
                                         top_p=float(kw.pop("top_p", 1.0)) if sample else 1.0,
                                         seed=1234 if sample else None))
        if not prompts:
            return []
        longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True))
        if self._engine is None or self._engine.config.max_model_len < longest:
            self._engine = Engine(self.model, self.tokenizer, EngineConfig(
                max_num_seqs=max(1, self.batch_size), max_model_len=max(longest,
                                                                        self.max_length)))
        seqs = self._engine.generate(prompts, params)
        texts = []
        for seq, until in zip(seqs, stops, strict=True):
            text = self.tokenizer.decode(seq.output_ids)
            for term in until:
                text = text.split(term)[0]
            texts.append(text)
            self.cache_hook.add_partial("generate_until", None, text)
        return texts


def task_manager(tasks: list[str], include_path: str | None = None):
    """``lm-eval``'s TaskManager that knows every one of ``tasks``: the local ones under
    ``include_path`` alone when they are all there (indexing lm-eval's thousands of tasks
    takes seconds), lm-eval's own otherwise. A task in neither: ValueError naming it and
    ``--include-path``."""
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ValueError("no task given: name lm-eval tasks or local ones (--include-path DIR)")
    if include_path is not None and not pathlib.Path(include_path).is_dir():
        raise ValueError(f"--include-path {include_path}: no such folder of task YAML files")
    manager = None
    if include_path is not None:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if any(t not in manager.all_tasks for t in tasks):
            manager = None
    manager = manager or _full_manager(include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = (f"nor under --include-path {include_path}" if include_path else
                 "(a local task: add --include-path DIR, the folder of its YAML file)")
        raise ValueError(f"unknown task(s) {', '.join(unknown)}: not an installed lm-eval "
                         f"task {where}")
    return manager


@functools.lru_cache(maxsize=4)
def _full_manager(include_path: str | None):
    """lm-eval's whole index (and ``include_path``'s tasks): built once a process, since
    compare and report.json ask it for the teacher and then the student."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def run_harness(checkpoint, tasks: list[str], *, include_path: str | None = None,
                limit: int | float | None = None, batch_size: int = 8,
                num_fewshot: int | None = None, out: str | pathlib.Path | None = None,
                model=None, tokenizer=None, log_samples: bool = False) -> dict:
    """Run ``lm-eval``'s ``tasks`` on a model in process; returns ``lm-eval``'s results dict
    (and writes it as ``results.json`` under ``out``).

    ``checkpoint`` is a :func:`~hyla.model.load_model` source, or a model already in memory
    (then ``tokenizer`` is needed; ``model=`` says the same). A task neither installed nor
    under ``include_path``: ValueError naming it. Tasks that need a download with no
    network raise a RuntimeError saying so."""
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable

    if checkpoint is not None and not isinstance(checkpoint, str | pathlib.PurePath):
        model, checkpoint = checkpoint, None          # a model object
    manager = task_manager(tasks, include_path)
    lm = HylaEvalLM(None if checkpoint is None else str(checkpoint), model=model,
                    tokenizer=tokenizer, batch_size=batch_size)
    try:
        results = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                  num_fewshot=num_fewshot, log_samples=log_samples,
                                  bootstrap_iters=0)
    except Exception as e:
        if _is_network_error(e):
            raise RuntimeError(
                f"task(s) {', '.join(tasks)} need a download (the Hugging Face hub) and "
                f"there is no network ({type(e).__name__}: {str(e)[:200]}). Define the task "
                "in a local YAML file with local data files (dataset_path: json, "
                "dataset_kwargs: {data_files: ...}) and pass --include-path DIR, or run "
                "where the hub is reachable") from e
        raise
    if out is not None:
        folder = pathlib.Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(
            json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
    return results


def _is_network_error(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is a failed connection or an offline hub."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        name = type(e).__name__
        text = str(e)
        if (isinstance(e, ConnectionError | TimeoutError) or "Connection" in name
                or "Offline" in name or "Timeout" in name
                or "huggingface.co" in text or "offline mode" in text.lower()
                or "Couldn't reach" in text):
            return True
        e = e.__cause__ or e.__context__
    return False

"""Which teacher layers a hybrid student keeps as softmax attention: ``--layers auto:N``.

A hybrid that keeps its teacher's perplexity can still lose what only softmax attention does
well: copying from far back (passkey retrieval fell from 8/8 to 0/8 for SmolLM2-135M with
every fourth layer kept). Which layers retrieve is a property of the teacher, so it is
measured on it, with two probes that have nothing to do with any benchmark:

- induction (:func:`induction_scores`): random tokens repeated once; the attention a query of
  the second copy puts on the token after its previous occurrence, hundreds of tokens back;
- reach (:func:`far_attention`): on a block of training text, the share of attention that
  falls beyond the student's window and sinks.

``choose_layers`` keeps ``N`` layers, taking the best of the two rankings in turn: late
induction layers copy, early far-reaching layers gather what they copy from. With
``ranking="kl"`` it keeps instead the ``N`` layers whose softmax attention, put back alone
into the all-linear student, removes the most vocabulary KL
(:mod:`hyla.train.distill.kl_ranking`).
"""

from __future__ import annotations

import torch

from hyla.model import Context, HylaLM
from hyla.train.distill.teacher_hooks import mixer_inputs


def _probabilities(mixer, h, ctx, queries: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Attention probabilities [H, len(queries), T] of ``queries`` (keys from each query's
    document ``start``)."""
    q, k = mixer.attention_qk(h, ctx)
    k = k.repeat_interleave(q.shape[2] // k.shape[2], 2)
    s = torch.einsum("bthd,bshd->bhts", q[:, queries].float(), k.float()) * q.shape[-1] ** -0.5
    keys = torch.arange(k.shape[1], device=k.device)[None]
    s = s.masked_fill((keys > queries[:, None]) | (keys < start[:, None]), -torch.inf)
    return s.softmax(-1)[0]


@torch.no_grad()
def induction_scores(teacher: HylaLM, *, length: int = 256, seed: int = 0) -> list[float]:
    """Per layer, the best head's mean induction attention on ``length`` random tokens
    repeated once (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(0, teacher.cfg.vocab_size, (length,), generator=g)
    device = next(teacher.parameters()).device
    ids = torch.cat([half, half])[None].to(device)
    ctx = Context.train(ids)
    seen = mixer_inputs(teacher, ids, ctx)
    queries = torch.arange(length, 2 * length - 1, device=device)
    targets = queries - length + 1              # the token after the previous occurrence
    start = torch.zeros_like(queries)
    scores = []
    for i, block in enumerate(teacher.blocks):
        p = _probabilities(block.mixer, seen.pop(i), ctx, queries, start)
        scores.append(float(p[:, torch.arange(len(queries)), targets].mean(-1).max()))
    return scores


@torch.no_grad()
def far_attention(teacher: HylaLM, ids: torch.Tensor, cu_seqlens: torch.Tensor | None, *,
                  window: int, sinks: int) -> list[float]:
    """Per layer, the mean over heads of the attention share beyond the last ``window``
    tokens and the first ``sinks`` of each document, for queries that have more than
    ``window`` tokens behind them (ids [1, T])."""
    ctx = Context.train(ids, cu_seqlens)
    seen = mixer_inputs(teacher, ids, ctx)
    pos = ctx.positions
    queries = (pos >= 4 * window).nonzero().squeeze(1)
    if queries.numel() == 0:
        queries = (pos >= window).nonzero().squeeze(1)
    if queries.numel() == 0:
        raise ValueError(f"the probe block has no token more than window={window} tokens "
                         f"into its document")
    start = queries - pos[queries]
    keys = torch.arange(ids.shape[1], device=ids.device)[None]
    inside = ((queries[:, None] - keys < window) | (keys - start[:, None] < sinks))
    scores = []
    for i, block in enumerate(teacher.blocks):
        p = _probabilities(block.mixer, seen.pop(i), ctx, queries, start)
        scores.append(float((p * ~inside).sum(-1).mean()))
    return scores


RANKINGS = ("probes", "kl")


def choose_layers(teacher: HylaLM, spec: str, probe: tuple | None = None, *, window: int = 64,
                  sinks: int = 4, ranking: str = "probes", linear: str = "G") -> str:
    """A layer pattern from ``"auto:N"``: ``linear`` everywhere but ``N`` softmax attention
    layers. ``probe`` is ``(ids [1, T], cu_seqlens)`` of training text. Any other ``spec`` is
    returned as it is.

    ``ranking``:
        - ``"probes"`` (default): taken in turn from the induction and the reach rankings
          (module doc); without ``probe`` (or one whose documents are no longer than the
          window), induction alone;
        - ``"kl"``: the top ``N`` by :func:`hyla.train.distill.kl_ranking.kl_layer_scores` on
          ``probe`` with a ``linear`` student of this ``window`` and ``sinks``; it needs
          ``probe``, and falls back to induction alone when the probe's documents are no
          longer than the window (the windowed student would be the teacher).

    Raises ValueError for a bad ``N``, an unknown ``ranking``, or ``"kl"`` without ``probe``.

    Example:
        >>> import dataclasses
        >>> from hyla.model import preset
        >>> t = HylaLM(dataclasses.replace(preset("debug"), layers="AAAA"))
        >>> p = choose_layers(t, "auto:2")
        >>> sorted(p)
        ['A', 'A', 'G', 'G']
    """
    if ranking not in RANKINGS:
        raise ValueError(f"layer ranking must be one of {', '.join(RANKINGS)}, got {ranking!r}")
    if not isinstance(spec, str) or not spec.startswith("auto"):
        return spec
    count = spec.partition(":")[2]
    n = teacher.cfg.n_layers
    if not count.isdigit() or not 0 <= int(count) <= n:
        raise ValueError(f"--layers auto:N needs N in 0..{n} (softmax attention layers to "
                         f"keep), got {spec!r}")
    if ranking == "kl" and probe is None:
        raise ValueError("layer ranking 'kl' needs a probe block of training text "
                         "(ids, cu_seqlens) to measure the vocabulary KL on")
    if probe is not None and int(Context.train(*probe).positions.max()) < window:
        probe = None                    # too short to see past the window: induction alone
    if ranking == "kl" and probe is not None:
        from hyla.train.distill.kl_ranking import kl_layer_scores

        scores = kl_layer_scores(teacher, [probe], window=window, sinks=sinks, linear=linear)
        keep = sorted(range(n), key=lambda i: -scores[i])[:int(count)]
        return "".join("A" if i in keep else linear for i in range(n))
    rankings = [induction_scores(teacher)]
    if probe is not None:
        rankings.append(far_attention(teacher, *probe, window=window, sinks=sinks))
    orders = [sorted(range(n), key=lambda i, s=s: -s[i]) for s in rankings]
    keep: list[int] = []
    while len(keep) < int(count):
        for order in orders:
            nxt = next(i for i in order if i not in keep)
            if len(keep) < int(count):
                keep.append(nxt)
    return "".join("A" if i in keep else linear for i in range(n))

"""Gated delta rule decode path: a few tokens at a time against a batch of states."""

from __future__ import annotations

import torch

from hyla.ops.checks.deltanet import (
    check_delta_inputs,
    l2norm,
    pop_aliases,
    resolve_decay,
    seq_offsets,
    state_dtype,
)
from hyla.ops.checks.gla import check_inplace, write_back


def recurrent_gated_delta(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                          output_final_state=False, cu_seqlens=None, use_qk_l2norm=False,
                          *, gk=None, inplace=False, **kwargs):
    """Step the gated delta rule token by token: the decode form (T = 1, or a short T).

    With ``inplace=True`` (inference only) the state batch is advanced *in place*:
    ``initial_state`` holds the final state afterwards (and is returned as it), so a decoder
    keeps one preallocated buffer. Otherwise ``initial_state`` is left as it was.

    Args/returns: as :func:`hyla.ops.deltanet.naive_recurrent_gated_delta`.

    Example:
        >>> state = torch.zeros(2, 4, 8, 8)                   # [N, H, K, V]
        >>> q, k, v = torch.randn(3, 2, 1, 4, 8)
        >>> g, beta = torch.full((2, 1, 4), -0.1), torch.full((2, 1, 4), 0.5)
        >>> o, s = recurrent_gated_delta(q, k, v, g, beta, initial_state=state,
        ...                              output_final_state=True, use_qk_l2norm=True,
        ...                              inplace=True)
        >>> s.data_ptr() == state.data_ptr()
        True
    """
    use_qk_l2norm = pop_aliases(kwargs, use_qk_l2norm)
    g = resolve_decay(g, gk)
    N, scale = check_delta_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    check_inplace(inplace, initial_state, q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = state_dtype(q, k, v, g, beta, initial_state)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    in_place = (inplace and not needs_grad and initial_state is not None
                and initial_state.dtype == dt)
    if in_place:
        state = initial_state
    elif initial_state is not None:
        state = initial_state.to(dt) if needs_grad else initial_state.to(dt).clone()
    else:
        state = q.new_zeros(N, H, K, V, dtype=dt)

    if cu_seqlens is None:
        o, state = _steps(q, k, v, g, beta, scale, state, in_place)
        state = write_back(initial_state, state, inplace)
        return o.to(q.dtype), (state if output_final_state else None)
    # Packed sequences: batch them by position within their sequence, so a batch of N
    # one-token sequences is still one batched step.
    spans = seq_offsets(B, T, cu_seqlens)
    o = q.new_zeros(1, T, H, V, dtype=dt)
    states = None if in_place else list(state.unbind(0))
    for i in range(max((e - s for _, s, e in spans), default=0)):
        live = [n for n, (_, s, e) in enumerate(spans) if s + i < e]
        pos = torch.tensor([spans[n][1] + i for n in live], device=q.device)
        idx = torch.tensor(live, device=q.device)
        cur = state[idx] if in_place else torch.stack([states[n] for n in live])
        o_i, new = _steps(q[0, pos, None], k[0, pos, None], v[0, pos, None], g[0, pos, None],
                          beta[0, pos, None], scale, cur, False)
        o = o.index_put((torch.zeros_like(pos), pos), o_i[:, 0].to(dt))
        if in_place:
            state[idx] = new
        else:
            for j, n in enumerate(live):
                states[n] = new[j]
    if not in_place and states:
        state = torch.stack(states)
    state = write_back(initial_state, state, inplace)
    return o.to(q.dtype), (state if output_final_state else None)


def _steps(q, k, v, g, beta, scale, state, in_place):
    """Advance state [N, H, K, V] over [N, T, H, *] inputs; returns (o [N, T, H, V], state)."""
    dt = state.dtype
    outs = []
    for t in range(q.shape[1]):
        gt = g[:, t].to(dt).exp()
        decay = gt.unsqueeze(-1) if gt.dim() == 3 else gt[..., None, None]
        kt = k[:, t].to(dt)
        if in_place:
            state.mul_(decay)
        else:
            state = state * decay
        delta = (v[:, t].to(dt) - torch.einsum("nhk,nhkv->nhv", kt, state)) \
            * beta[:, t].to(dt).unsqueeze(-1)
        update = kt.unsqueeze(-1) * delta.unsqueeze(-2)
        state = state.add_(update) if in_place else state + update
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t].to(dt) * scale, state))
    o = torch.stack(outs, dim=1) if outs else state.new_zeros(*q.shape[:3], state.shape[-1])
    return o, state


def delta_decode_step(q, k, v, g, beta, state, scale=None):
    """One token for N sequences, state [N, H, K, V] float32 updated in place; no checks.

    The unchecked T == 1 form of :func:`recurrent_gated_delta` (no value-reading checks, so
    ``torch.compile`` traces it as one graph). q, k: [N, 1, H, K] (already normalised if
    wanted); v: [N, 1, H, V]; g: [N, 1, H] or [N, 1, H, K]; beta: [N, 1, H]. Returns o
    [N, 1, H, V] in q's dtype.

    Example:
        >>> q, k, v = torch.randn(3, 2, 1, 4, 8); g = -torch.rand(2, 1, 4)
        >>> beta = torch.rand(2, 1, 4); s0 = torch.zeros(2, 4, 8, 8); s1 = s0.clone()
        >>> o = delta_decode_step(q, k, v, g, beta, s0)
        >>> ref, _ = recurrent_gated_delta(q, k, v, g, beta, initial_state=s1, inplace=True)
        >>> torch.allclose(o, ref), torch.equal(s0, s1)
        (True, True)
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, _ = _steps(q, k, v, g, beta, scale, state, True)
    return o.to(q.dtype)

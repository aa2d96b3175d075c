"""GLA decode path: a few tokens at a time against a batch of states, updated in place."""

from __future__ import annotations

import torch

from hyla.ops.checks.gla import (
    check_gla_inputs,
    check_inplace,
    resolve_gate,
    seq_offsets,
    write_back,
)


def recurrent_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, *, gk=None, inplace=False):
    """Step GLA token by token: the decode form (T = 1, or a short T such as draft tokens).

    With ``inplace=True`` (inference only) the state batch is advanced *in place*:
    ``initial_state`` holds the final state afterwards (and is returned as it), so a decoder
    keeps one preallocated buffer (with an fp32 state it allocates nothing per step).
    Otherwise ``initial_state`` is left as it was, as in flash-linear-attention.

    Args/returns: as :func:`hyla.ops.gla.naive_recurrent_gla`.

    Example:
        >>> state = torch.zeros(2, 4, 8, 8)                   # [N, H, K, V]
        >>> q = k = v = torch.randn(2, 1, 4, 8)
        >>> g = torch.full((2, 1, 4, 8), -0.1)
        >>> o, s = recurrent_gla(q, k, v, gk=g, initial_state=state, output_final_state=True)
        >>> s.data_ptr() == state.data_ptr(), bool(state.abs().sum() == 0)
        (False, True)
        >>> o, s = recurrent_gla(q, k, v, g, initial_state=state, output_final_state=True,
        ...                      inplace=True)
        >>> s.data_ptr() == state.data_ptr()
        True
    """
    g = resolve_gate(g, gk)
    N, scale = check_gla_inputs(q, k, v, g, scale, initial_state, cu_seqlens)
    check_inplace(inplace, initial_state, q, k, v, g)
    B, T, H, K = q.shape
    V = v.shape[-1]
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, initial_state))
    in_place = (inplace and not needs_grad and initial_state is not None
                and initial_state.dtype == torch.float32)
    if in_place:
        state = initial_state
    elif initial_state is not None:
        state = initial_state.float().clone() if not needs_grad else initial_state.float()
    else:
        state = q.new_zeros(N, H, K, V, dtype=torch.float32)

    if cu_seqlens is None:
        o, state = _step_batch(q, k, v, g, scale, state, in_place)
    else:
        # Packed sequences: batch them by position within their sequence, so a decode batch
        # of N one-token sequences is still one batched step.
        spans = seq_offsets(B, T, cu_seqlens)
        o = q.new_zeros(1, T, H, V, dtype=torch.float32)
        longest = max((e - s for _, s, e in spans), default=0)
        states = list(state.unbind(0)) if not in_place else None
        for i in range(longest):
            live = [n for n, (_, s, e) in enumerate(spans) if s + i < e]
            pos = torch.tensor([spans[n][1] + i for n in live], device=q.device)
            idx = torch.tensor(live, device=q.device)
            cur = state[idx] if in_place else torch.stack([states[n] for n in live])
            o_i, new = _step_batch(q[0, pos, None], k[0, pos, None], v[0, pos, None],
                                   g[0, pos, None], scale, cur, False)
            o = o.index_put((torch.zeros_like(pos), pos), o_i[:, 0].float())
            if in_place:
                state[idx] = new
            else:
                for j, n in enumerate(live):
                    states[n] = new[j]
        if not in_place:
            state = torch.stack(states) if states else state
    state = write_back(initial_state, state, inplace)
    return o.to(q.dtype), (state if output_final_state else None)


def _step_batch(q, k, v, g, scale, state, in_place):
    """Advance state [N, H, K, V] over q/k/v/g [N, T, H, *]; returns (o [N, T, H, V], state)."""
    outs = []
    for t in range(q.shape[1]):
        decay = g[:, t].float().exp().unsqueeze(-1)
        kt, vt = k[:, t].float().unsqueeze(-1), v[:, t].float().unsqueeze(-2)
        if in_place:        # k v^T added without a temporary [N, H, K, V]
            state.mul_(decay).addcmul_(kt, vt)
        else:
            state = state * decay + kt * vt
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t].float() * scale, state))
    o = torch.stack(outs, dim=1) if outs else state.new_zeros(*q.shape[:3], state.shape[-1])
    return o, state


def gla_decode_step(q, k, v, g, state, scale=None):
    """One token for N sequences, state [N, H, K, V] fp32 updated in place; no input checks.

    The unchecked form of ``recurrent_gla`` for T == 1 that ``torch.compile`` traces as one
    graph (the checks read tensor values, which would break the graph). q, k, g: [N, 1, H,
    K]; v: [N, 1, H, V]. Returns o [N, 1, H, V] in q's dtype.

    Example:
        >>> q, k, v = torch.randn(3, 2, 1, 4, 8); g = -torch.rand(2, 1, 4, 8)
        >>> s0 = torch.zeros(2, 4, 8, 8); s1 = s0.clone()
        >>> o = gla_decode_step(q, k, v, g, s0)
        >>> ref, _ = recurrent_gla(q, k, v, g, initial_state=s1, inplace=True)
        >>> torch.allclose(o, ref), torch.equal(s0, s1)
        (True, True)
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, _ = _step_batch(q, k, v, g, scale, state, True)
    return o.to(q.dtype)

"""The specification of the gated delta rule: a token-by-token recurrence in float32.

Per head, with the state S of shape [K, V]:

    S_t = diag(exp(g_t)) S_{t-1}                        (g_t: one value a head, or a key channel)
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T          (the delta rule: overwrite what k_t held)
    o_t = scale * S_t^T q_t
"""

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


def naive_recurrent_gated_delta(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                output_final_state=False, cu_seqlens=None, use_qk_l2norm=False,
                                *, gk=None, inplace=False, **kwargs):
    """Reference gated delta rule, one token at a time in float32 (float64 for float64
    inputs). Slow; the fast forms are checked against it.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H] in (0, 1).
        g: log decay (<= 0), [B, T, H] (Gated DeltaNet) or [B, T, H, K] (KDA).
        scale: query scale, default K ** -0.5.
        initial_state: optional [N, H, K, V] (N = B, or the sequences of cu_seqlens).
        cu_seqlens: optional int [N + 1] offsets of packed sequences (B must be 1).
        gk: flash-linear-attention's name for a decay a key channel; inplace: write the
            final state into ``initial_state`` (see :func:`hyla.ops.gla.chunk_gla`).
        use_qk_l2norm: L2-normalise q and k over K first (fla's ``use_qk_l2norm_in_kernel``).
    Returns:
        o [B, T, H, V] in q's dtype; final_state [N, H, K, V] float32, or None.

    Example:
        >>> q, k = torch.randn(2, 1, 5, 2, 4); v = torch.randn(1, 5, 2, 3)
        >>> g, beta = -torch.rand(1, 5, 2), torch.rand(1, 5, 2)
        >>> o, s = naive_recurrent_gated_delta(q, k, v, g, beta, output_final_state=True,
        ...                                    use_qk_l2norm=True)
        >>> o.shape, s.shape
        (torch.Size([1, 5, 2, 3]), torch.Size([1, 2, 4, 3]))
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
    qf, kf, vf, bf = (x.to(dt) for x in (q, k, v, beta))
    gf = g.to(dt)
    if gf.dim() == 3:
        gf = gf.unsqueeze(-1)                      # [B, T, H, 1]: broadcasts over K
    o = qf.new_zeros(B, T, H, V)
    finals = []
    for n, (b, start, end) in enumerate(seq_offsets(B, T, cu_seqlens)):
        s = initial_state[n].to(dt) if initial_state is not None else qf.new_zeros(H, K, V)
        for t in range(start, end):
            s = s * gf[b, t].exp()[..., None]
            kt = kf[b, t]
            delta = (vf[b, t] - torch.einsum("hk,hkv->hv", kt, s)) * bf[b, t][:, None]
            s = s + kt[..., None] * delta[:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", qf[b, t] * scale, s)
        finals.append(s)
    final_state = torch.stack(finals) if output_final_state or inplace else None
    final_state = write_back(initial_state, final_state, inplace)
    return o.to(q.dtype), (final_state if output_final_state else None)

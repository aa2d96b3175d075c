"""The specification of GLA: an fp32 token-by-token recurrence.

    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t          (S: [K, V] per head)
    o_t = (scale * q_t) S_t
"""

from __future__ import annotations

import torch

from hyla.ops.checks.gla import (
    check_gla_inputs,
    check_inplace,
    resolve_gate,
    seq_offsets,
    write_back,
)


def naive_recurrent_gla(q, k, v, g=None, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None, *, gk=None, inplace=False):
    """Reference GLA, one token at a time in float32. Slow; used to check the fast forms.

    Args:
        q, k, g: [B, T, H, K]; g is the log forget gate (<= 0) per key channel.
        v: [B, T, H, V].
        initial_state: optional [N, H, K, V] (N = B, or sequences in cu_seqlens).
        cu_seqlens: optional [N + 1] offsets of packed sequences (B must be 1).
        gk: flash-linear-attention's name for ``g``; inplace: write the final state into
            ``initial_state`` (see :func:`hyla.ops.gla.chunk_gla`).
    Returns:
        o: [B, T, H, V] in q's dtype; final_state: [N, H, K, V] float32, or None.

    Example:
        >>> q = k = torch.randn(1, 5, 2, 4); v = torch.randn(1, 5, 2, 3)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(1, 5, 2, 4))
        >>> o, s = naive_recurrent_gla(q, k, v, g, output_final_state=True)
        >>> o.shape, s.shape
        (torch.Size([1, 5, 2, 3]), torch.Size([1, 2, 4, 3]))
    """
    g = resolve_gate(g, gk)
    N, scale = check_gla_inputs(q, k, v, g, scale, initial_state, cu_seqlens)
    check_inplace(inplace, initial_state, q, k, v, g)
    B, T, H, K = q.shape
    V = v.shape[-1]
    qf, kf, vf, gf = (x.float() for x in (q, k, v, g))
    o = qf.new_zeros(B, T, H, V)
    finals = []
    for n, (b, start, end) in enumerate(seq_offsets(B, T, cu_seqlens)):
        if initial_state is not None:
            s = initial_state[n].float()
        else:
            s = qf.new_zeros(H, K, V)
        for t in range(start, end):
            s = s * gf[b, t].exp()[..., None] + kf[b, t][..., None] * vf[b, t][:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", qf[b, t] * scale, s)
        finals.append(s)
    final_state = torch.stack(finals) if output_final_state or inplace else None
    final_state = write_back(initial_state, final_state, inplace)
    return o.to(q.dtype), (final_state if output_final_state else None)

"""Within-chunk GLA scores A_ij = sum_k q_ik k_jk exp(G_ik - G_jk), j <= i, without overflow.

Hierarchical secondary chunking: a block of P rows is split into n = 4 sub-blocks of s rows.
Query sub-block a and an earlier key sub-block b meet through two reference rows, the last row
of block a-1 and the last row of block b:

    exp(G_i - G_j) = exp(G_i - G_{a-1,end}) * exp(G_{a-1,end} - G_{b,end}) * exp(G_{b,end} - G_j)

Every exponent is <= 0, so every factor is <= 1 whatever the gates, and all key blocks b < a
are one matmul against query block a. The diagonal sub-blocks recurse (64 -> 16 -> 4 -> 1).
Each level costs a few K exponentials per token, where a flat elementwise treatment of S-row
diagonal blocks would cost S * K: this is what makes the eager path fast on any device.
A block whose gates span little is done directly, in one matmul (see SAFE_SPAN).
"""

from __future__ import annotations

import torch

BRANCH = 4  # sub-blocks per block
# A block whose gates fall by at most this much (per channel, first row to last) is done in one
# matmul around its middle row: every factor stays within exp(+-span), far from overflow in the
# matmul dtype (fp32/bf16: e^60 ~ 1e26; fp16 tops out at 65504 ~ e^11, so e^8 there), and the
# products are exact to rounding. Mild gates (the common case) take this path for the whole
# chunk; harsh ones recurse.
SAFE_SPAN = {torch.float16: 8.0}
DEFAULT_SAFE_SPAN = 60.0


def intra_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Lower-triangular (diagonal included) scores of one block per leading index.

    Args:
        q, k: [..., P, K] in the matmul dtype, P a power of two; G: [..., P, K] float32
            cumulative log gates, non-increasing along P.
    Returns:
        A: [..., P, P] float32, zero above the diagonal.

    Example:
        >>> q, k = torch.randn(2, 16, 8), torch.randn(2, 16, 8)
        >>> G = torch.nn.functional.logsigmoid(torch.randn(2, 16, 8)).cumsum(1)
        >>> intra_scores(q, k, G).shape
        torch.Size([2, 16, 16])
    """
    P, K = q.shape[-2:]
    if P == 1:
        return (q.float() * k.float()).sum(-1, keepdim=True)
    span = float((G[..., 0, :] - G[..., -1, :]).detach().max())
    if span <= SAFE_SPAN.get(q.dtype, DEFAULT_SAFE_SPAN):
        return _direct_scores(q, k, G)
    n = min(BRANCH, P)
    s = P // n
    lead = q.shape[:-2]
    qb, kb, Gb = (x.reshape(*lead, n, s, K) for x in (q, k, G))
    diag = intra_scores(qb, kb, Gb)  # [..., n, s, s]
    G_end = Gb[..., -1, :]  # [..., n, K]
    q_ref = qb[..., 1:, :, :] * (Gb[..., 1:, :, :] - G_end[..., :-1, None, :]).exp()
    k_end = kb[..., :-1, :, :] * (G_end[..., :-1, None, :] - Gb[..., :-1, :, :]).exp()

    rows = [torch.cat([diag[..., 0, :, :], diag.new_zeros(*lead, s, (n - 1) * s)], dim=-1)]
    for a in range(1, n):
        bridge = (G_end[..., a - 1 : a, :] - G_end[..., :a, :]).exp()  # [..., a, K]
        keys = (k_end[..., :a, :, :] * bridge.unsqueeze(-2)).reshape(*lead, a * s, K)
        keys = keys.to(q.dtype)
        query = q_ref[..., a - 1, :, :].to(q.dtype)  # [..., s, K]
        if s == 1:  # a matmul of one row is a dot product; skip the tiny-GEMM overhead
            pair = (query * keys).sum(-1).unsqueeze(-2)
        else:
            pair = torch.matmul(query, keys.transpose(-1, -2)).to(diag.dtype)
        parts = [pair, diag[..., a, :, :]]
        if a < n - 1:
            parts.append(diag.new_zeros(*lead, s, (n - 1 - a) * s))
        rows.append(torch.cat(parts, dim=-1))
    return torch.cat(rows, dim=-2)


def _direct_scores(q, k, G):
    """One matmul around the middle row; only valid when the block's gate span is small."""
    P = q.shape[-2]
    ref = G[..., P // 2 : P // 2 + 1, :]
    q_ref = (q * (G - ref).exp()).to(q.dtype)
    k_ref = (k * (ref - G).exp()).to(q.dtype)
    # tril, not a multiply by a mask: entries above the diagonal may be huge, never inf * 0.
    return torch.matmul(q_ref, k_ref.transpose(-1, -2)).float().tril()

"""Within-chunk GLA scores A_ij = sum_k q_ik k_jk exp(G_ik - G_jk), j <= i, without overflow.

Hierarchical secondary chunking: a block of P rows is split into 4 sub-blocks. A pair of
sub-blocks a > b meets through two reference rows, the last row of block a-1 and the last row
of block b:

    exp(G_i - G_j) = exp(G_i - G_{a-1,end}) * exp(G_{a-1,end} - G_{b,end}) * exp(G_{b,end} - G_j)

Each factor has a non-positive exponent, so each is <= 1 whatever the gates, and a pair costs
one small matmul. The diagonal sub-blocks recurse; blocks of at most 4 rows are done
elementwise. Per token this costs a few K exponentials, against S * K for a flat elementwise
treatment of S-row diagonal blocks, which is what makes the eager CPU path fast.
"""

from __future__ import annotations

import torch

BRANCH = 4  # sub-blocks per block
LEAF = 4  # blocks this small are computed elementwise


def intra_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Lower-triangular (diagonal included) scores of one block per leading index.

    Args:
        q, k: [..., P, K] in the matmul dtype; G: [..., P, K] float32 cumulative log gates
            (non-increasing along P).
    Returns:
        A: [..., P, P] float32, zero above the diagonal.

    Example:
        >>> q, k = torch.randn(2, 16, 8), torch.randn(2, 16, 8)
        >>> G = torch.nn.functional.logsigmoid(torch.randn(2, 16, 8)).cumsum(1)
        >>> intra_scores(q, k, G).shape
        torch.Size([2, 16, 16])
    """
    P = q.shape[-2]
    if P <= LEAF:
        return _leaf_scores(q, k, G)
    n = BRANCH
    s = P // n
    lead = q.shape[:-2]
    K = q.shape[-1]
    qb, kb, Gb = (x.reshape(*lead, n, s, K) for x in (q, k, G))
    G_end = Gb[..., -1, :]  # [..., n, K]: last row of every sub-block
    diag = intra_scores(qb, kb, Gb)  # [..., n, s, s]

    a_idx, b_idx = torch.tril_indices(n, n, -1, device=q.device)  # pairs a > b
    starts = torch.arange(1, n, device=q.device)
    # q_i exp(G_i - G_{a-1,end}) for blocks a >= 1; k_j exp(G_{b,end} - G_j) for every block b.
    q_ref = qb[..., 1:, :, :].float() * (Gb[..., 1:, :, :] - G_end[..., starts - 1, None, :]).exp()
    k_ref = (kb.float() * (G_end.unsqueeze(-2) - Gb).exp()).to(q.dtype)
    bridge = (G_end[..., a_idx - 1, :] - G_end[..., b_idx, :]).exp()  # [..., pairs, K]
    q_pair = (q_ref[..., a_idx - 1, :, :] * bridge.unsqueeze(-2)).to(q.dtype)
    pair = torch.matmul(q_pair, k_ref[..., b_idx, :, :].transpose(-1, -2)).float()

    # Assemble the n x n grid of s x s blocks: zero above, pairs below, recursion on it.
    zero = diag.new_zeros(diag.shape[:-3] + (s, s))
    pair_of = {(a, b): i for i, (a, b) in enumerate(zip(a_idx.tolist(), b_idx.tolist(),
                                                         strict=True))}
    rows = []
    for a in range(n):
        blocks = []
        for b in range(n):
            if a == b:
                blocks.append(diag[..., a, :, :])
            elif a > b:
                blocks.append(pair[..., pair_of[(a, b)], :, :])
            else:
                blocks.append(zero)
        rows.append(torch.cat(blocks, dim=-1))
    return torch.cat(rows, dim=-2)


def _leaf_scores(q, k, G):
    P = q.shape[-2]
    rows = torch.arange(P, device=q.device)
    causal = (rows.view(P, 1) >= rows.view(1, P)).unsqueeze(-1)
    gap = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal, -torch.inf)
    return (q.float().unsqueeze(-2) * k.float().unsqueeze(-3) * gap.exp()).sum(-1)

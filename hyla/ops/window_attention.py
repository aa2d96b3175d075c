"""Softmax attention over a sliding window plus a few "sink" tokens, in O(T * window).

The exact-softmax half of a linearised attention layer (LoLCATs' sliding window, with
StreamingLLM's attention sinks): query ``i`` of a document sees key ``j`` when ``j <= i`` and
either ``i - j < window`` (the last ``window`` tokens, its own included) or ``j < sinks`` (the
document's first tokens, which pretrained models use as a place to put attention they do not
need: without them a windowed Llama's perplexity goes up ~8x). What a query can see is a fixed
number of keys, so a layer built on it keeps a fixed-size state.

Queries are processed in blocks of ``block >= window`` rows; block ``b`` reads keys of blocks
``b - 1`` and ``b`` plus the sinks of the one document running from before them, so the cost
and memory are O(T * (window + sinks)) however many documents a row packs.
Tensors are [B, T, H, D]; keys and values may have fewer heads (grouped-query attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MASKED = -1e30       # finite: a fully masked padding row must not produce NaN gradients


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """Which keys at positions ``k_pos`` [..., S] queries at ``q_pos`` [..., T] see: [..., T, S].
    A key position below 0 marks an empty slot.

    Example:
        >>> visible(torch.arange(4), torch.arange(4), 2, 1).int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]]
    """
    q, k = q_pos[..., :, None], k_pos[..., None, :]
    return (k >= 0) & (k <= q) & ((q - k < window) | (k < sinks))


def ring_positions(last: torch.Tensor, window: int) -> torch.Tensor:
    """The positions [N, window] a ring of ``window`` rows holds once it has stored every
    position up to ``last`` [N] (row ``p % window`` holds position ``p``); -1 where a row
    holds nothing yet. A sliding-window layer's keys kept this way take fixed memory.

    Example:
        >>> ring_positions(torch.tensor([1, 5]), 4).tolist()
        [[0, 1, -1, -1], [4, 5, 2, 3]]
    """
    rows = torch.arange(window, device=last.device)
    held = last[:, None] - torch.remainder(last[:, None] - rows[None], window)
    return torch.where(held >= 0, held, -1)


def sink_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, *, window: int, sinks: int = 0,
                          cu_seqlens: torch.Tensor | None = None,
                          cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                          scale: float | None = None, return_lse: bool = False):
    """Sliding-window + sink softmax attention of T new tokens (see the module doc).

    Args:
        q: [B, T, H, D]; k: [B, T, H_kv, D]; v: [B, T, H_kv, D_v]: the new tokens' queries,
            keys and values (rotary already applied).
        positions: [T] long, each token's position in its document (restarting at each
            ``cu_seqlens`` boundary; a prefill chunk's absolute positions).
        window: keys a query sees behind it, itself included (>= 1).
        sinks: first tokens of a document every later query also sees (>= 0).
        cu_seqlens: [N + 1] document offsets in a packed row (B == 1); no token sees another
            document.
        cache: ``(keys [B, E, H_kv, D], values [B, E, H_kv, D_v], positions [B, E])`` of
            earlier tokens of the same sequence (its sinks and window; position -1 for empty
            slots), seen by the rule above. No new token may be a sink of a document the
            cache belongs to unless its position says so.
        scale: softmax scale, default D ** -0.5.
        return_lse: also return the log-sum-exp of each row's scores [B, H, T] (float32).
    Returns:
        o [B, T, H, D_v] in q's dtype (and lse).

    Example:
        >>> q, k, v = torch.randn(3, 1, 10, 2, 8).unbind(0)
        >>> o = sink_window_attention(q, k, v, torch.arange(10), window=3, sinks=1)
        >>> from hyla.ops.attention import attention
        >>> ref = attention(q, k, v, window=10)
        >>> o.shape, torch.allclose(sink_window_attention(q, k, v, torch.arange(10),
        ...                                               window=10), ref, atol=1e-5)
        (torch.Size([1, 10, 2, 8]), True)
    """
    if not isinstance(window, int) or window < 1 or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"window must be an int >= 1 and sinks an int >= 0, got "
                         f"{window!r}, {sinks!r}")
    B, T, H, D = q.shape
    if k.shape[:2] != (B, T) or v.shape[:3] != k.shape[:3] or H % k.shape[2]:
        raise ValueError(f"k, v must be [B, T, H_kv, D] with H_kv dividing H={H}, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)} for q {tuple(q.shape)}")
    if positions.shape != (T,):
        raise ValueError(f"positions must be [T={T}], got {tuple(positions.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs B == 1, got B={B}")
    scale = D ** -0.5 if scale is None else scale
    dev = q.device
    doc = (torch.zeros(T, dtype=torch.long, device=dev) if cu_seqlens is None else
           torch.bucketize(torch.arange(T, device=dev), cu_seqlens[1:].to(dev), right=True))
    positions = positions.to(dev)
    blk = max(window, 16)
    nb = -(-T // blk)
    pad = nb * blk - T
    rep = H // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)

    # Keys every block reads: the cache (earlier tokens of this sequence: one document).
    if cache is not None:
        ck, cv, cpos = cache
        sk = ck.to(q.dtype).repeat_interleave(rep, 2)                      # [B, E, H, D]
        sv = cv.to(q.dtype).repeat_interleave(rep, 2)
        spos, sdoc = cpos.to(dev), torch.zeros_like(cpos, device=dev)       # [B, E]
    else:
        sk, sv = k[:, :0], v[:, :0]
        spos = sdoc = torch.zeros(B, 0, dtype=torch.long, device=dev)

    # Block b reads blocks b - 1 and b of the new tokens, which hold the sinks of every
    # document starting there; the document already running at block b - 1's first key has
    # its sinks further back: gathered, one document a block, so the cost stays O(T * W).
    kp = F.pad(k, (0, 0, 0, 0, blk, pad))                                 # [B, blk+T+pad, ...]
    vp = F.pad(v, (0, 0, 0, 0, blk, pad))
    pos_p = F.pad(positions, (blk, pad), value=-1)
    doc_p = F.pad(doc, (blk, pad), value=-2)
    qb = F.pad(q, (0, 0, 0, 0, 0, pad)).view(B, nb, blk, H, D)
    first = (torch.arange(nb, device=dev) - 1) * blk                       # block b-1's start
    t0 = first.clamp(min=0)
    start = t0 - positions[t0]                                             # its document's
    a = torch.arange(sinks, device=dev)
    gidx = start[:, None] + a[None]                                        # [nb, S]
    gok = (first[:, None] >= 0) & (gidx >= 0) & (gidx < first[:, None])
    gidx = gidx.clamp(0, T - 1)
    gk, gv = k[:, gidx], v[:, gidx]                                        # [B, nb, S, H, D]
    gpos = torch.where(gok, a[None].expand(nb, -1), -1)
    gdoc = doc[t0][:, None].expand(-1, sinks)
    idx = (torch.arange(nb, device=dev)[:, None] * blk
           + torch.arange(2 * blk, device=dev)[None])                      # [nb, 2 blk]
    wk, wv = kp[:, idx], vp[:, idx]                                        # [B, nb, 2blk, H, D]
    wpos, wdoc = pos_p[idx], doc_p[idx]                                    # [nb, 2 blk]
    qpos = F.pad(positions, (0, pad), value=-1).view(nb, blk)
    qdoc = F.pad(doc, (0, pad), value=-3).view(nb, blk)

    # scores in float32 (bf16 products rounded before the softmax lose ~10x accuracy)
    acc = torch.float32 if q.dtype != torch.float64 else torch.float64
    qa = qb.to(acc)
    s_win = torch.einsum("bnthd,bnshd->bnhts", qa, wk.to(acc)) * scale    # [B,nb,H,blk,2blk]
    s_snk = torch.einsum("bnthd,bnshd->bnhts", qa, gk.to(acc)) * scale    # [B,nb,H,blk,S]
    s_sh = torch.einsum("bnthd,bshd->bnhts", qa, sk.to(acc)) * scale       # [B,nb,H,blk,E]
    same = qdoc[:, :, None]
    m_win = visible(qpos, wpos, window, sinks) & (same == wdoc[:, None, :])
    m_snk = visible(qpos, gpos, window, sinks) & (same == gdoc[:, None, :])
    m_sh = (visible(qpos[None].expand(B, -1, -1).flatten(1), spos, window, sinks)
            & (qdoc.flatten()[None, :, None] == sdoc[:, None, :])).view(B, nb, blk, -1)
    scores = torch.cat([s_sh.masked_fill(~m_sh[:, :, None], _MASKED),
                        s_snk.masked_fill(~m_snk[None, :, None], _MASKED),
                        s_win.masked_fill(~m_win[None, :, None], _MASKED)], -1)
    lse = torch.logsumexp(scores, -1, keepdim=True)
    p = torch.exp(scores - lse).to(q.dtype)
    E, S = sk.shape[1], gk.shape[2]
    o = (torch.einsum("bnhts,bshd->bnthd", p[..., :E], sv)
         + torch.einsum("bnhts,bnshd->bnthd", p[..., E:E + S], gv)
         + torch.einsum("bnhts,bnshd->bnthd", p[..., E + S:], wv))
    o = o.reshape(B, nb * blk, H, -1)[:, :T]
    if return_lse:
        return o, lse.squeeze(-1).permute(0, 2, 1, 3).reshape(B, H, nb * blk)[..., :T]
    return o

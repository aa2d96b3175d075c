"""Softmax attention in the [B, T, H, D] layout, on top of ``F.scaled_dot_product_attention``.

- :func:`attention`: training / fresh prefill; causal or not, grouped-query, packed documents;
- :func:`attention_with_cache`: decode and chunked prefill, queries placed after a key cache of
  per-sequence length (right-padded batch).

Both take learned attention ``sinks`` (gpt-oss, MiMo-V2-Flash): one logit a query head that
joins every row's softmax and carries no value, so a row may attend to "nothing"
(:func:`with_sinks`).

Keys and values may have fewer heads than queries (grouped-query attention, ``H % H_kv == 0``):
query head ``h`` reads key/value head ``h // (H // H_kv)``, as in Llama.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_qkv(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 4-D tensor [B, T, H, D], got {shape}")
    B, _, H, D = q.shape
    if k.shape[0] != B or k.shape[-1] != D:
        raise ValueError(f"k must be [B, S, H_kv, D] = [{B}, S, H_kv, {D}] to match q, "
                         f"got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be [B, S, H_kv, D_v] with [B, S, H_kv] = {list(k.shape[:3])} "
                         f"of k, got {tuple(v.shape)}")
    if k.shape[2] == 0 or H % k.shape[2]:
        raise ValueError(f"k/v heads must divide the query heads H={H} (grouped-query "
                         f"attention), got H_kv={k.shape[2]}")


def _sdpa(q, k, v, *, scale, causal=False, mask=None, sinks=None):
    """SDPA on [B, T, H, D] tensors (it wants [B, H, T, D]); GQA without repeating k/v.
    ``sinks`` needs a boolean ``mask`` (it broadcasts to [B, H, T, S])."""
    if sinks is not None:
        q, k, v, mask, scale = with_sinks(q, k, v, mask, sinks, scale)
    gqa = q.shape[2] != k.shape[2]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, is_causal=causal, scale=scale,
                                       enable_gqa=gqa)
    return o.transpose(1, 2)


def with_sinks(q, k, v, mask, sinks, scale=None):
    """Attention sinks as one more key, first, that every query sees: its value is zero and
    its logit for query head ``h`` is ``sinks[h]``, so ``softmax([scores, sink])`` without
    the sink's column is what plain SDPA computes on the returned tensors (exactly
    transformers' ``eager_attention_forward`` with ``s_aux``).

    The logit comes from the keys: ``G = H / H_kv`` extra dims, query head ``h`` holds the
    one-hot of ``h % G`` there and the sink key of KV head ``j`` holds ``sinks[j*G:(j+1)*G]
    / scale`` (other keys zeros), so no [B, H, T, S] float bias is built and GQA still
    shares KV heads. Returns (q, k, v, mask, scale) for SDPA in the [B, T, H, D] layout;
    ``mask`` [..., T, S] bool -> [..., T, 1 + S].

    Example:
        >>> q = torch.randn(1, 3, 4, 8); kv = torch.randn(1, 3, 2, 8)
        >>> mask = torch.ones(3, 3, dtype=torch.bool).tril()
        >>> o = _sdpa(q, kv, kv, scale=None, mask=mask, sinks=torch.full((4,), -1e4))
        >>> torch.allclose(o, _sdpa(q, kv, kv, scale=None, mask=mask), atol=1e-6)
        True
    """
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    scale = D ** -0.5 if scale is None else scale
    onehot = torch.eye(G, dtype=q.dtype, device=q.device).repeat(Hkv, 1)       # [H, G]
    q = torch.cat([q, onehot.expand(B, T, H, G)], dim=-1)
    sink_key = (sinks.to(torch.float32) / scale).to(k.dtype).view(1, 1, Hkv, G)
    sink_key = torch.cat([k.new_zeros(1, 1, Hkv, D), sink_key], dim=-1).expand(B, 1, Hkv, D + G)
    k = torch.cat([sink_key, F.pad(k, (0, G))], dim=1)
    v = torch.cat([v.new_zeros(B, 1, Hkv, v.shape[-1]), v], dim=1)
    mask = torch.cat([torch.ones_like(mask[..., :1]), mask], dim=-1)
    return q, k, v, mask, scale


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (sliding-window) visibility [..., T, S] of keys at ``k_pos`` [..., S] from
    queries at ``q_pos`` [..., T]: ``k <= q`` and, with a window, ``q - k < window`` (the
    last ``window`` tokens, the query's own included: transformers' sliding window).

    Example:
        >>> window_mask(torch.arange(3), torch.arange(3), 2).int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    q, k = q_pos[..., :, None], k_pos[..., None, :]
    mask = k <= q
    return mask if window is None else mask & (k > q - window)


def attention(q, k, v, *, scale=None, causal=True, cu_seqlens=None, window=None, sinks=None):
    """Softmax attention, optionally causal, optionally over packed documents.

    Args:
        q: [B, T, H, D]; k: [B, S, H_kv, D]; v: [B, S, H_kv, D_v], with H % H_kv == 0.
        scale: softmax scale, default D ** -0.5.
        causal: query t sees keys 0..t (requires S == T).
        cu_seqlens: optional int tensor [N + 1] of document offsets (0 ... T) for packed
            sequences; needs B == 1 and S == T. No token attends across a boundary.
        window: causal sliding window: query t sees keys t - window + 1 ... t (None: all).
        sinks: optional [H] attention-sink logits (:func:`with_sinks`); needs causal=True.
    Returns:
        o: [B, T, H, D_v] in q's dtype.

    Example:
        >>> q = torch.randn(1, 7, 4, 8); kv = torch.randn(1, 7, 2, 8)
        >>> attention(q, kv, kv, cu_seqlens=torch.tensor([0, 3, 7])).shape
        torch.Size([1, 7, 4, 8])
    """
    _check_qkv(q, k, v)
    B, T = q.shape[:2]
    if (causal or cu_seqlens is not None) and k.shape[1] != T:
        raise ValueError(f"k/v must have S == T={T} keys for causal or packed attention, "
                         f"got S={k.shape[1]}")
    if window is not None:
        if not causal:
            raise ValueError("window needs causal=True (a sliding window looks back only)")
        if window >= T:                 # the window covers every key: plain causal
            window = None
    if sinks is not None and not causal:
        raise ValueError("sinks needs causal=True")
    if window is not None or sinks is not None:     # an explicit mask per document
        offsets = [0, T] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
        outs = []
        for s, e in zip(offsets[:-1], offsets[1:], strict=True):
            pos = torch.arange(e - s, device=q.device)
            mask = window_mask(pos, pos, window)
            outs.append(_sdpa(q[:, s:e], k[:, s:e], v[:, s:e], scale=scale, mask=mask,
                              sinks=sinks))
        return torch.cat(outs, dim=1) if outs else q.new_zeros(*q.shape[:3], v.shape[-1])
    if cu_seqlens is None:
        return _sdpa(q, k, v, scale=scale, causal=causal and T > 1)
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    # One SDPA call per document keeps memory at sum(L_i^2) and lets fused kernels use
    # is_causal, instead of a dense [T, T] block-diagonal mask.
    outs = [_sdpa(q[:, s:e], k[:, s:e], v[:, s:e], scale=scale, causal=causal and e - s > 1)
            for s, e in zip(offsets[:-1], offsets[1:], strict=True) if e > s]
    if not outs:
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    return torch.cat(outs, dim=1)


def attention_with_cache(q, k, v, kv_lens, *, scale=None, window=None, sinks=None):
    """Attention of new queries against a right-padded key/value cache, causally.

    The cache already holds the new tokens' keys: sequence ``b`` has ``kv_lens[b]`` valid keys
    (slots ``kv_lens[b]:`` are padding and ignored), and its ``T`` queries are the last ``T``
    of them, at absolute positions ``kv_lens[b] - T + t``; query ``t`` sees keys ``0 ...
    kv_lens[b] - T + t``. ``T == 1`` is batched decode; ``B == 1`` is chunked prefill.

    Args:
        q: [B, T, H, D]; k: [B, S, H_kv, D]; v: [B, S, H_kv, D_v] (right-padded caches).
        kv_lens: int tensor [B] (or list), each in [T, S].
        scale: softmax scale, default D ** -0.5.
        window: causal sliding window (see :func:`attention`); None: every cached key.
        sinks: optional [H] attention-sink logits (:func:`with_sinks`).
    Returns:
        o: [B, T, H, D_v] in q's dtype.

    Example:
        >>> q = torch.randn(2, 1, 4, 8); kv = torch.randn(2, 6, 2, 8)
        >>> attention_with_cache(q, kv, kv, torch.tensor([3, 6])).shape    # 2 and 5 cached
        torch.Size([2, 1, 4, 8])
    """
    _check_qkv(q, k, v)
    B, T = q.shape[:2]
    S = k.shape[1]
    if not isinstance(kv_lens, torch.Tensor):
        kv_lens = torch.tensor(kv_lens, dtype=torch.long)
    if kv_lens.shape != (B,) or kv_lens.is_floating_point():
        raise ValueError(f"kv_lens must be an integer tensor [B] = [{B}], got "
                         f"{tuple(kv_lens.shape)} {kv_lens.dtype}")
    lens = kv_lens.to(device=q.device, dtype=torch.long)
    if B and (int(lens.min()) < T or int(lens.max()) > S):
        raise ValueError(f"kv_lens must be in [T, S] = [{T}, {S}] (the cache includes the "
                         f"new tokens), got {lens.tolist()}")
    pos = lens[:, None] - T + torch.arange(T, device=q.device)            # [B, T]
    mask = window_mask(pos, torch.arange(S, device=q.device)[None], window)   # [B, T, S]
    return _sdpa(q, k, v, scale=scale, mask=mask[:, None], sinks=sinks)


def masked_attention(q, k, v, mask, *, scale=None, sinks=None):
    """Softmax attention where a boolean ``mask`` [..., T, S] (broadcast to [B, H, T, S])
    says which keys each query sees, e.g. keys held in a ring in any order.

    Example:
        >>> q = torch.randn(1, 2, 4, 8); kv = torch.randn(1, 3, 2, 8)
        >>> mask = torch.tensor([[True, True, False], [True, True, True]])
        >>> masked_attention(q, kv, kv, mask).shape
        torch.Size([1, 2, 4, 8])
    """
    _check_qkv(q, k, v)
    return _sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks)


def check_cu_seqlens(cu_seqlens, B: int, T: int) -> list[int]:
    """Validate packed-document offsets (B == 1, int [N + 1], 0 ... T); return them as a list."""
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size B == 1 (packed sequences), got B={B}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
            or cu_seqlens.is_floating_point() or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1] of offsets, "
                         f"got {cu_seqlens!r}")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {offsets}")
    if any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    return offsets


def attend_one_query(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
                     ) -> torch.Tensor:
    """One token's attention over a cache held row-major in pieces, as paged KV blocks hold
    it: q [H, D], ``keys[i]`` [rows_i, H_kv, D] and ``values[i]`` [rows_i, H_kv, Dv]
    (contiguous; together all the rows, in any order) -> [H, Dv], softmax scale 1 / sqrt(D),
    no mask (every row is visible).

    SDPA on a [H_kv, rows, D] view of that layout reads it at 4-5 GB/s on one CPU thread;
    here each query head becomes a row that is zero outside its KV head's dims, so the scores
    and the output are GEMMs over the cache as it lies, read once and in order (the zeros
    cost flops, which a memory-bound step has to spare). Measured over 30 SmolLM2 layers,
    one thread (``benchmarks/long_kv_attention.py``): at 16K rows 198 against 248 ms in fp32,
    117 against 270 in bf16; at 4K 1.1x and 1.9x; below about 2K rows SDPA is as fast or
    faster, so one short piece goes to SDPA instead.

    Example:
        >>> q, k, v = torch.randn(4, 8), torch.randn(50, 2, 8), torch.randn(50, 2, 8)
        >>> ref = F.scaled_dot_product_attention(q.view(2, 2, 8), k.transpose(0, 1),
        ...                                      v.transpose(0, 1)).reshape(4, 8)
        >>> out = attend_one_query(q, [k[30:], k[:30]], [v[30:], v[:30]])
        >>> torch.allclose(out, ref, atol=1e-5)
        True
    """
    H, D = q.shape
    h_kv, dv = values[0].shape[1:]
    heads = torch.arange(H, device=q.device)
    group = heads // (H // h_kv)
    wide = q.new_zeros(H, h_kv, D)
    wide[heads, group] = q
    wide = wide.view(H, h_kv * D)
    scores = [wide @ k.reshape(k.shape[0], h_kv * D).T for k in keys]       # [H, rows_i]
    scores = scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)
    probs = (scores.float() * D ** -0.5).softmax(-1).to(values[0].dtype)
    out, at = None, 0
    for v in values:
        part = probs[:, at:at + v.shape[0]] @ v.reshape(v.shape[0], h_kv * dv)
        out = part if out is None else out.add_(part)
        at += v.shape[0]
    return out.view(H, h_kv, dv)[heads, group]

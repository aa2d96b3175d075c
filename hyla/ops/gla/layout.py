"""Where each token sits once sequences are cut into chunks.

Every sequence (a batch row, or a packed document of ``cu_seqlens``) is padded on its own to a
multiple of the chunk size with zero tokens (k = v = 0, g = 0: they neither add to nor decay
the state), so chunks never straddle two sequences and padding costs less than one chunk per
sequence. The scan over chunks then runs on a grid [N sequences, P chunk positions].
"""

from __future__ import annotations

import torch


class ChunkLayout:
    """Map [B, T, H, D] tensors to chunks [M, H, C, D] and chunk states to a [N, P] grid."""

    def __init__(self, B: int, T: int, cu_seqlens, chunk_size: int, device):
        self.B, self.T, self.C = B, T, chunk_size
        self.packed = cu_seqlens is not None
        C = chunk_size
        if not self.packed:
            self.N, self.P = B, -(-T // C)
            self.num_chunks = B * self.P
            return
        offsets = cu_seqlens.tolist()
        spans = list(zip(offsets[:-1], offsets[1:], strict=True))
        self.N = len(spans)
        counts = [-(-(e - s) // C) for s, e in spans]
        self.P = max(counts, default=0)
        self.num_chunks = sum(counts)
        seq, pos, rows = [], [], []
        for n, ((s, e), c) in enumerate(zip(spans, counts, strict=True)):
            seq += [n] * c
            pos += range(c)
            padded = torch.arange(s, s + c * C)
            rows.append(torch.where(padded < e, padded, T))  # row T is the zero pad row
        self.seq = torch.tensor(seq, dtype=torch.long, device=device)
        self.pos = torch.tensor(pos, dtype=torch.long, device=device)
        self.rows = torch.cat(rows).to(device) if rows else torch.zeros(0, dtype=torch.long)
        # Inverse: for every original token, its row in the padded stream.
        inverse = torch.empty(T, dtype=torch.long)
        start = 0
        for (s, e), c in zip(spans, counts, strict=True):
            inverse[s:e] = torch.arange(start, start + e - s)
            start += c * C
        self.inverse = inverse.to(device)
        # Per token, the offset just past its sequence: reverse cumsums stop there.
        self.seq_end = torch.tensor(sum(([e] * (e - s) for s, e in spans), []), dtype=torch.long,
                                    device=device)
        self.last_tokens = [(n, e - 1) for n, (s, e) in enumerate(spans) if e > s]

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] -> [M, H, C, D], contiguous (the chunk math reshapes it freely)."""
        B, T, H, D = x.shape
        C = self.C
        if not self.packed:
            pad = self.P * C - T
            if pad:
                x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
            return x.view(B * self.P, C, H, D).transpose(1, 2).contiguous()
        flat = torch.cat([x[0], x.new_zeros(1, H, D)])[self.rows]
        return flat.view(self.num_chunks, C, H, D).transpose(1, 2).contiguous()

    def from_chunks(self, o: torch.Tensor) -> torch.Tensor:
        """[M, H, C, V] -> [B, T, H, V]."""
        M, H, C, V = o.shape
        flat = o.transpose(1, 2).reshape(M * C, H, V)
        if not self.packed:
            return flat.view(self.B, self.P * C, H, V)[:, : self.T]
        return flat[self.inverse].unsqueeze(0)

    def to_grid(self, decay: torch.Tensor, update: torch.Tensor):
        """Per-chunk decay [M, H, K] and update [M, H, K, V] -> [N, P, ...] (identity padding)."""
        if not self.packed:
            return (decay.view(self.N, self.P, *decay.shape[1:]),
                    update.view(self.N, self.P, *update.shape[1:]))
        idx = (self.seq, self.pos)
        decay_grid = decay.new_ones(self.N, self.P, *decay.shape[1:]).index_put(idx, decay)
        update_grid = update.new_zeros(self.N, self.P, *update.shape[1:]).index_put(idx, update)
        return decay_grid, update_grid

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """[N, P, ...] -> [M, ...]."""
        if not self.packed:
            return grid.reshape(self.num_chunks, *grid.shape[2:])
        return grid[self.seq, self.pos]

    def reverse_cumsum(self, x: torch.Tensor) -> torch.Tensor:
        """sum_{t' >= t} x[:, t'] over each sequence: x [B, T, ...] -> [B, T, ...]."""
        total = x.flip(1).cumsum(1).flip(1)
        if not self.packed:
            return total
        after = torch.cat([total, torch.zeros_like(total[:, :1])], dim=1)[:, self.seq_end]
        return total - after

    def add_at_last_tokens(self, x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] plus values [N, ...] at the last token of each (non-empty) sequence."""
        if not self.packed:
            if self.T == 0:
                return x
            return torch.cat([x[:, :-1], (x[:, -1] + values).unsqueeze(1)], dim=1)
        x = x.clone()
        for n, t in self.last_tokens:
            x[0, t] += values[n]
        return x

"""``P``: softmax attention and a Mamba-2 layer side by side on the same normed input, their
outputs summed (TII's Falcon-H1 layer: ``attn(x) + mamba(x)``).

Each half is the layer of its own kind (:class:`~hyla.model.mixers.attention.AttentionMixer`
with ``mixer_options["attention"]``, :class:`~hyla.model.mixers.mamba2.Mamba2Mixer` with
``mixer_options["mamba2"]``), so its math, its kernels and its tests are theirs. The state
of a ``P`` layer is both states: the Mamba-2 layer's fixed entries (``state``, ``conv``) and
the attention's growing ones (``keys``, ``values``), under one layer index; the serving
engine pages the growing ones and keeps the fixed ones in slots, as for any layer.
"""

from __future__ import annotations

from hyla.model.mixers.attention import AttentionMixer
from hyla.model.mixers.base import Mixer, StateSpec, register_mixer
from hyla.model.mixers.mamba2 import Mamba2Mixer


@register_mixer("P")
class ParallelHybridMixer(Mixer):
    """``attn`` (softmax attention) and ``ssm`` (Mamba-2) on one input, summed.

    Example:
        >>> import torch
        >>> from hyla.model.config import HylaConfig
        >>> from hyla.model.context import Context
        >>> cfg = HylaConfig(vocab_size=256, d_model=64, layers="P", n_heads=4, ffn_dim=128,
        ...                  mixer_options={"mamba2": {"head_dim": 16, "state_size": 8}})
        >>> ParallelHybridMixer.state_spec(cfg).names
        ('state', 'conv', 'keys', 'values')
        >>> layer = ParallelHybridMixer(cfg)
        >>> layer(torch.randn(2, 5, 64), Context.train(torch.zeros(2, 5, dtype=torch.long))).shape
        torch.Size([2, 5, 64])
    """

    kind = "parallel_hybrid"
    label = "attention + Mamba-2"
    state_label = "KV cache and SSM state"

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        self.attn = AttentionMixer(cfg, layer_idx)
        self.ssm = Mamba2Mixer(cfg, layer_idx)

    @classmethod
    def check_config(cls, cfg) -> None:
        AttentionMixer.check_config(cfg)
        Mamba2Mixer.check_config(cfg)

    @classmethod
    def state_spec(cls, cfg) -> StateSpec:
        ssm, attn = Mamba2Mixer.state_spec(cfg), AttentionMixer.state_spec(cfg)
        return StateSpec(cls.kind, fixed=ssm.fixed, per_token=attn.per_token)

    @classmethod
    def pair_flops(cls, cfg) -> float:
        return AttentionMixer.pair_flops(cfg)

    @classmethod
    def token_flops(cls, cfg) -> float:
        return AttentionMixer.token_flops(cfg) + Mamba2Mixer.token_flops(cfg)

    def forward(self, x, ctx):
        return self.attn(x, ctx) + self.ssm(x, ctx)

    def attention_qk(self, x, ctx):
        return self.attn.attention_qk(x, ctx)

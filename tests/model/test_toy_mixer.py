"""A mixer defined here alone plugs into everything through the protocol: training, the
model's prefill/decode, the serving engine, SequenceState and the memory arithmetic."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyla.eval.memory import memory_report, state_bytes
from hyla.model import MIXERS, HylaLM, Mixer, SequenceState, StateSpec, TensorSpec, preset
from hyla.model import register_mixer as register
from hyla.model.generate import generate
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams


class EMAMixer(Mixer):
    """Per head, an exponential moving average of the values: s = a s + (1 - a) v, y = o(s).
    State: one fixed [H, D] float32 matrix."""

    kind = "ema"

    def __init__(self, cfg, layer_idx=0):
        super().__init__(cfg, layer_idx)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.decay_logit = nn.Parameter(torch.linspace(-1.0, 2.0, cfg.n_heads))

    @classmethod
    def state_spec(cls, cfg):
        return StateSpec(cls.kind, fixed=(TensorSpec("ema", (cfg.n_heads, cfg.head_dim),
                                                     torch.float32),))

    def _scan(self, v, s):
        """v [T, H, D], s [H, D] -> outputs [T, H, D], final state."""
        a = torch.sigmoid(self.decay_logit)[:, None]
        outs = []
        for t in range(v.shape[0]):
            s = a * s + (1 - a) * v[t].float()
            outs.append(s)
        return torch.stack(outs), s

    def forward(self, x, ctx):
        B, T, _ = x.shape
        H, D = self.cfg.n_heads, self.cfg.head_dim
        v = self.v_proj(x).view(B, T, H, D)
        zero = x.new_zeros(H, D, dtype=torch.float32)
        if ctx.mode == "train":
            cu = ctx.cu_seqlens.tolist() if ctx.cu_seqlens is not None else None
            rows = []
            for b in range(B):
                bounds = cu or [0, T]
                rows.append(torch.cat([self._scan(v[b, s:e], zero)[0]
                                       for s, e in zip(bounds[:-1], bounds[1:], strict=True)]))
            y = torch.stack(rows)
        else:
            buf = ctx.buffers[self.layer_idx]["ema"]
            state = ctx.load_fixed(buf)
            if ctx.mode == "prefill":
                cu = ctx.cu_seqlens.tolist()
                outs, finals = [], []
                for j in range(len(cu) - 1):
                    o, s = self._scan(v[0, cu[j]:cu[j + 1]], state[j])
                    outs.append(o)
                    finals.append(s)
                y, new = torch.cat(outs)[None], torch.stack(finals)
            else:                                   # one token for each of B sequences
                a = torch.sigmoid(self.decay_logit)[:, None]
                new = a * state + (1 - a) * v[:, 0].float()
                y = new[:, None]
            ctx.store_fixed(buf, new)
        return self.o_proj(y.to(x.dtype).reshape(B, T, H * D))


@pytest.fixture
def gxa():
    register("X")(EMAMixer)
    try:
        cfg = dataclasses.replace(preset("debug"), layers="GXA")
        torch.manual_seed(0)
        yield cfg, HylaLM(cfg)
    finally:
        MIXERS.pop("X")


def test_registered_and_in_config(gxa):
    cfg, model = gxa
    assert MIXERS["X"] is EMAMixer and isinstance(model.blocks[1].mixer, EMAMixer)
    assert model.blocks[1].mixer.layer_idx == 1


def test_trains_one_step(gxa):
    cfg, model = gxa
    ids = torch.randint(0, cfg.vocab_size, (1, 24))
    cu = torch.tensor([0, 10, 24])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.blocks[1].mixer.decay_logit.detach().clone()
    losses = []
    for _ in range(2):
        logits = model(ids[:, :-1], cu_seqlens=torch.tensor([0, 10, 23]))
        loss = F.cross_entropy(logits[0], ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        assert model.blocks[1].mixer.decay_logit.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert not torch.equal(before, model.blocks[1].mixer.decay_logit)
    assert losses[1] < losses[0]
    # packed documents: the second document does not see the first
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu)[0, 10:]
        alone = model(ids[:, 10:])[0]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_forward_equals_prefill_then_decode(gxa):
    cfg, model = gxa
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (13,))
    full = model(ids[None])[0]
    st = model.new_state()
    pre = model.prefill(ids[:9], st)
    torch.testing.assert_close(pre, full[:9], atol=1e-4, rtol=1e-4)
    other = model.new_state()
    model.prefill(ids[:4], other)
    for t in range(9, 13):
        step = model.decode(ids[t:t + 1].repeat(2), [st, other])   # batched with another
        torch.testing.assert_close(step[0], full[t], atol=1e-4, rtol=1e-4)
    assert st.num_tokens == 13 and other.num_tokens == 8


def test_engine_serves_it_greedy_like_the_model(gxa):
    cfg, model = gxa
    model.eval()
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], list(range(40, 61))]
    eng = Engine(model, config=EngineConfig(max_num_seqs=2, max_model_len=64,
                                            max_num_batched_tokens=16))
    seqs = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    for p, s in zip(prompts, seqs, strict=True):
        assert s.output_ids == generate(model, p, 6, temperature=0)


def test_state_and_memory_count_its_bytes(gxa):
    cfg, model = gxa
    model.eval()
    st = model.new_state()
    model.prefill(torch.arange(17), st)
    ema = cfg.n_heads * cfg.head_dim * 4
    assert st.bytes_by_kind()["ema"] == ema
    want = state_bytes(cfg, 17, kv_dtype=torch.float32)
    assert want["ema"] == ema and st.nbytes == want["total"]
    assert SequenceState.unflatten(st.flatten()).nbytes == st.nbytes
    report = memory_report(cfg, 17)
    assert report["layers"]["ema"] == 1 and report["state_breakdown"]["ema"] == ema

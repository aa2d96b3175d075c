"""SequenceState: sizes, flat buffer round trip, corrupt buffers rejected."""

import dataclasses

import pytest
import torch

from hyla.model import HylaLM, SequenceState, preset


def filled_state(dtype=torch.float32):
    torch.manual_seed(0)
    model = HylaLM(dataclasses.replace(preset("debug"), layers="GAGA")).to(dtype).eval()
    state = model.new_state()
    model.prefill(torch.randint(0, 256, (37,)), state)
    return state


def test_empty_sizes():
    cfg = preset("debug")
    st = SequenceState.empty(cfg)
    gla = cfg.n_heads * cfg.head_k_dim * cfg.head_v_dim * 4
    assert st.num_tokens == 0
    # one key per registered kind, 0 for those the model lacks
    assert {k: b for k, b in st.bytes_by_kind().items() if b} == {"gla": 3 * gla}
    assert st.bytes_by_kind()["attention"] == 0
    assert st.kinds == ["gla", "gla", "gla", "attention"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nbytes_and_kinds(dtype):
    st = filled_state(dtype)
    cfg = preset("debug")
    total = sum(t.numel() * t.element_size() for ts in st.tensors for t in ts)
    assert st.nbytes == total == sum(st.bytes_by_kind().values())
    assert st.num_tokens == 37
    assert st.bytes_by_kind()["attention"] == 2 * 2 * 37 * cfg.kv_dim * dtype.itemsize
    assert st.tensors[0][0].dtype == torch.float32          # GLA state is always fp32
    assert st.tensors[1][0].dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_bit_exact(dtype):
    st = filled_state(dtype)
    buf = st.flatten()
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    assert st.nbytes <= buf.numel() < st.nbytes + 4096
    back = SequenceState.unflatten(buf.clone())
    assert back.kinds == st.kinds and back.num_tokens == st.num_tokens
    for a, b in zip(st.tensors, back.tensors, strict=True):
        for ta, tb in zip(a, b, strict=True):
            assert ta.dtype == tb.dtype and ta.shape == tb.shape
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))
    assert torch.equal(back.flatten(), buf)


def test_round_trip_then_continue():
    """A shipped state decodes exactly like the original."""
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    st = model.new_state()
    model.prefill(torch.randint(0, 256, (21,)), st)
    copy = SequenceState.unflatten(st.flatten())
    tok = torch.tensor([5])
    assert torch.equal(model.decode(tok, [st]), model.decode(tok, [copy]))


def test_empty_round_trip():
    st = SequenceState.empty(preset("debug"))
    back = SequenceState.unflatten(st.flatten())
    assert back.nbytes == st.nbytes and back.tensors[3][0].shape == (0, 2, 16)


@pytest.mark.parametrize("where", ["magic", "version", "header", "payload", "last"])
def test_corrupt_buffer_rejected(where):
    buf = filled_state().flatten()
    pos = {"magic": 0, "version": 8, "header": 30, "payload": buf.numel() // 2,
           "last": buf.numel() - 1}[where]
    bad = buf.clone()
    bad[pos] ^= 0x5A
    with pytest.raises(ValueError, match="buffer"):
        SequenceState.unflatten(bad)


@pytest.mark.parametrize("cut", [3, 40, 200, -1])
def test_truncated_buffer_rejected(cut):
    buf = filled_state().flatten()
    with pytest.raises(ValueError, match="buffer"):
        SequenceState.unflatten(buf[:cut])


def test_bad_buffer_type():
    with pytest.raises(ValueError, match="1-D uint8"):
        SequenceState.unflatten(torch.zeros(10))
    with pytest.raises(ValueError, match="buffer"):
        buf = filled_state().flatten()
        SequenceState.unflatten(torch.cat([buf, torch.zeros(1, dtype=torch.uint8)]))

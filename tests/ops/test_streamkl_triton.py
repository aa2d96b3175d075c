"""The Triton StreamKL kernels against the materialised fp64 reference, run on the CPU by
Triton's interpreter (no GPU needed).

TRITON_INTERPRET must be set before triton is imported (it is read when kernels are
decorated), hence before the imports below. The interpreter runs every kernel program in
numpy, a few seconds per call here, so shapes are small and tiles (16 x 32) small enough that
no length is a multiple of them and diagonal tiles are partial.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from test_streamkl import compare, make_inputs, reference, run  # noqa: E402

from hyla.ops.streamkl import attention_kl, chunk_attention_kl  # noqa: E402
from hyla.ops.streamkl import triton as kl_triton  # noqa: E402

if not kl_triton.INTERPRET:
    pytest.skip("hyla.ops.streamkl.triton was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

TILES = {"block_m": 16, "block_n": 32}


def check(inputs, *, teacher=True, seed=1, dtype=torch.float32, **kw):
    """Value and gradients of the triton backend against the fp64 reference; with
    ``teacher=False`` the teacher's inputs do not require grad and must get none."""
    B, T, H = inputs[0].shape[:3]
    cot = torch.randn(B, H, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref = reference(inputs, cot, **kw)
    if teacher:
        got = run(kl_triton.triton_attention_kl, inputs, cot, **TILES, **kw)
    else:
        q_t, k_t = (x.detach() for x in inputs[:2])
        kl = kl_triton.triton_attention_kl(q_t, k_t, *inputs[2:], reduction="none", **TILES,
                                           **kw)
        (kl.double() * cot).sum().backward()
        # the reference still differentiated the teacher: compare the student only
        got = [kl.detach(), ref[1], ref[2], inputs[2].grad, inputs[3].grad]
    compare("triton", got, ref, dtype)


# B, T, H, H_kv teacher, H_kv student, D teacher, D student
SHAPES = [(2, 63, 2, 2, 2, 16, 16), (1, 130, 4, 2, 1, 32, 8), (1, 1, 2, 1, 2, 8, 8)]
SHAPE_IDS = ["B2-T63-H2-mha", "B1-T130-H4-gqa2/1-D32/8", "B1-T1"]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_triton_matches_naive(shape, causal):
    check(make_inputs(*shape, torch.float32), causal=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_16bit_inputs(dtype):
    """Tiles are upcast to fp32 in the kernel; gradients come back in the input dtype."""
    check(make_inputs(1, 63, 2, 1, 2, 16, 8, dtype), dtype=dtype, causal=True)


def test_triton_without_teacher_grads():
    check(make_inputs(1, 63, 4, 1, 2, 16, 8, torch.float32), teacher=False, causal=True)


@pytest.mark.parametrize("S", [40, 90], ids=["S40<T", "S90>T"])
def test_triton_queries_and_keys_of_different_length(S):
    """Causal with S < T leaves the first T - S rows fully masked: KL 0, no NaN."""
    inputs = make_inputs(1, 70, 2, 1, 2, 8, 8, torch.float32, S=S)
    check(inputs, causal=True)
    kl = kl_triton.triton_attention_kl(*inputs, reduction="none", **TILES)
    if S < 70:
        assert (kl[..., : 70 - S] == 0).all()


def test_triton_identical_sides_give_zero():
    q, k = torch.randn(1, 40, 2, 8), torch.randn(1, 40, 1, 8)
    assert kl_triton.triton_attention_kl(q, k, q, k, reduction="none", **TILES).abs().max() == 0


def test_backend_selection_and_fallback():
    inputs = make_inputs(1, 20, 2, 1, 2, 8, 8, torch.float32)
    got = attention_kl(*inputs, backend="triton")
    torch.testing.assert_close(got, chunk_attention_kl(*inputs), rtol=1e-5, atol=1e-6)
    # CPU tensors: None picks chunk even though triton imports.
    assert attention_kl(*inputs).item() == chunk_attention_kl(*inputs).item()
    # Unsupported by the kernels (packed documents, fp64): the chunk backend's result exactly.
    cu = torch.tensor([0, 7, 20])
    assert attention_kl(*inputs, backend="triton", cu_seqlens=cu).item() == \
        chunk_attention_kl(*inputs, cu_seqlens=cu).item()
    fp64 = [x.detach().double() for x in inputs]
    assert attention_kl(*fp64, backend="triton").item() == chunk_attention_kl(*fp64).item()
    with pytest.raises(ValueError, match="block_m"):
        kl_triton.triton_attention_kl(*inputs, block_m=24)

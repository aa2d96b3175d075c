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

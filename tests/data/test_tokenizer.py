"""Tokenizer loading: end-of-text tokens named by Hugging Face configs."""


def test_named_eos_token_from_tokenizer_config(tmp_path):
    """A Llama-style tokenizer (``</s>``, no spare id) keeps its own end-of-text token."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from hyla.data.tokenizer import BPETokenizer, load_tokenizer
    from hyla.model.formats.hf.tokenizer import load_hf_tokenizer

    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("z") + 1))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    n = tok.get_vocab_size(with_added_tokens=True)
    hyla_tok = load_hf_tokenizer(tmp_path, vocab_size=n)       # no spare id for <|endoftext|>
    assert hyla_tok.eos_token == "</s>" and hyla_tok.eos_id == tok.token_to_id("</s>")
    out = tmp_path / "saved"
    out.mkdir()
    hyla_tok.save(out / "tokenizer.json")
    again = load_tokenizer(out)
    assert isinstance(again, BPETokenizer) and again.eos_id == hyla_tok.eos_id

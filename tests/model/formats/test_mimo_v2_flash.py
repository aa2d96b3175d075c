"""MiMo-V2-Flash in and out: a small random ``MiMoV2FlashForCausalLM`` with window and full
layers mixed (sinks, twice the KV heads and their own rope theta in the window layers), a
value head dim of its own, a value scale, partial rotary, q/k/v biases, and dense and MoE
layers mixed (sigmoid router, score-correction bias, group-limited top-k, scaling); every
norm, bias, sink and router bias randomised. Sequences are longer than the window."""

from __future__ import annotations

import json
import re

import pytest
import torch
from family_checks import check_export, check_prefill_decode, rel
from hf_reference import reference

from hyla.data.tokenizer import train_bpe
from hyla.model import load_model
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB, WINDOW, T = 300, 7, 24



def mimo_model(seed: int = 0, **overrides):
    mod = reference("mimo_v2_flash")
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16,
              sliding_window=WINDOW, attention_value_scale=0.7, attention_bias=True,
              layer_types=["full_attention", "sliding_attention", "sliding_attention",
                           "full_attention"],
              mlp_layer_types=["dense", "sparse", "dense", "sparse"],
              n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_group=4,
              topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5, rms_norm_eps=1e-5,
              tie_word_embeddings=False, rope_parameters={
                  "full_attention": {"rope_type": "default", "rope_theta": 5e4,
                                     "partial_rotary_factor": 0.334},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                        "partial_rotary_factor": 0.5}})
    config = mod.MiMoV2FlashConfig(**(kw | overrides))
    torch.manual_seed(seed)
    model = mod.MiMoV2FlashForCausalLM(config).eval()
    with torch.no_grad():   # everything that could hide behind its init value, randomised
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
            elif name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    bpe = train_bpe(["def f(x):\n    return x + 1\n"] * 40, vocab_size=VOCAB - 4)
    path = tmp_path_factory.mktemp("mimo")
    ref = mimo_model()
    ref.save_pretrained(path, safe_serialization=True)
    bpe.save(path / "tokenizer.json")
    return ref, path


def test_logits_prefill_decode_and_export(saved, tmp_path):
    ref, path = saved
    model, tok = load_model(path)
    cfg = model.cfg
    assert cfg.layers == "AAAA" and cfg.ffn_layers == "SESE"
    assert [s.group for s in model.state_specs] == ["full attention", "window", "window",
                                                    "full attention"]
    assert [cfg.layer_config(i).sliding_window for i in range(4)] == [None, 7, 7, None]
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids).logits
    assert rel(ours, theirs) <= 1e-4
    check_prefill_decode(model, ids[1], ours[1], cuts=(9, 17))
    check_export(model, tok, tmp_path / "export", transformers, ref, ids)


def test_engine_greedy_and_prefix_cache_equal_transformers_generate(saved):
    ref, path = saved
    model, _ = load_model(path)
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, VOCAB, (17,), generator=g).tolist()
    prompts = [torch.randint(0, VOCAB, (3,), generator=g).tolist()] + [
        shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (2, 5)]
    want = [ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    eng = Engine(model, None, EngineConfig(max_model_len=64, block_size=4))
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [s.output_ids for s in eng.generate(prompts[:2], greedy)] == want[:2]
    (hit,) = eng.generate(prompts[2:], greedy)      # the shared prefix's blocks are cached
    assert hit.num_cached_tokens == 16 and hit.output_ids == want[2]


@pytest.mark.parametrize("field,value", [
    ("hidden_act", "gelu"), ("n_shared_experts", 1), ("add_full_attention_sink_bias", True),
    ("hybrid_layer_pattern", [0, 0, 0, 0]), ("swa_num_key_value_heads", 1),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4,
                                            "factor": 2.0}}),
])
def test_refusals(saved, tmp_path, field, value):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field) as err:
        load_model(bad)
    assert "config.json" in str(err.value)


def mtp_parts(ref, n: int = 2, seed: int = 3) -> dict:
    """MiMo's MTP layers built from transformers' own modules, as vLLM and SGLang run them:
    per layer enorm, hnorm, eh_proj, a decoder layer like the stack's window layers with a
    dense MLP (layer 2 of mimo_model is one), final_layernorm; every weight randomised."""
    mod, cfg = reference("mimo_v2_flash"), ref.config
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    torch.manual_seed(seed)
    layers = []
    for _ in range(n):
        parts = {"enorm": mod.MiMoV2FlashRMSNorm(d, eps), "hnorm": mod.MiMoV2FlashRMSNorm(d, eps),
                 "eh_proj": torch.nn.Linear(2 * d, d, bias=False),
                 "block": mod.MiMoV2FlashDecoderLayer(cfg, 2),
                 "final_layernorm": mod.MiMoV2FlashRMSNorm(d, eps)}
        with torch.no_grad():   # modules built alone are not initialised
            for m in parts.values():
                m.eval()
                for name, p in m.named_parameters():
                    p.normal_(1.0 if "norm" in name or isinstance(
                        m, mod.MiMoV2FlashRMSNorm) else 0.0, 0.3 if "norm" in name else 0.1)
        layers.append(parts)
    return layers


def with_mtp(path, dest, layers, block_norm="pre_mlp_layernorm"):
    """A copy of the saved model whose file holds ``layers`` as ``model.mtp.layers.{j}.*``
    (the release's names; ``block_norm``: the block's second norm's)."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    for f in path.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    w = load_file(dest / "model.safetensors")
    for j, parts in enumerate(layers):
        for name, m in parts.items():
            for k, v in m.state_dict().items():
                k = k.replace("post_attention_layernorm", block_norm)
                k = k if name == "block" else f"{name}.{k}"
                w[f"model.mtp.layers.{j}.{k}"] = v.contiguous()
    save_file(w, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def mtp_want(ref, parts, ids, h):
    """The reference MTP layer's output at each pair (h[p], ids[p + 1]): its window mask."""
    x = parts["eh_proj"](torch.cat([parts["enorm"](ref.model.embed_tokens(ids[None, 1:])),
                                    parts["hnorm"](h[None, :-1])], dim=-1))
    n = x.shape[1]
    pos = torch.arange(n)[None]
    i, j = pos[0, :, None], pos[0, None, :]
    mask = torch.zeros(n, n).masked_fill((j > i) | (i - j >= WINDOW), float("-inf"))
    y = parts["block"](x, attention_mask=mask[None, None], position_ids=pos,
                       position_embeddings=ref.model.rotary_emb(x, pos, "sliding_attention"))
    return parts["final_layernorm"](y)[0]


@pytest.mark.parametrize("block_norm", ["pre_mlp_layernorm", "post_attention_layernorm"])
def test_mtp_layers_match_transformers_modules(saved, tmp_path, block_norm):
    from hyla.model.context import Context
    from hyla.model.mtp import MTPState

    ref, path = saved
    layers = mtp_parts(ref)
    model, _ = load_model(with_mtp(path, tmp_path / "mtp", layers, block_norm))
    assert model.cfg.mtp_layers == 2 and model.mtp.cfg.sliding_window == WINDOW
    ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        h = model(ids[None], hidden=True)[0]
        want = [mtp_want(ref, parts, ids, h) for parts in layers]
        state = MTPState(model)
        got = state.run(ids[1:].tolist(), h[:-1])            # longer than the window
        pieces = MTPState(model)                             # as drafting feeds it
        split = [pieces.run(ids[1:10].tolist(), h[:9])]
        for p in range(9, T - 1):
            pieces.run([5], h[p:p + 1])         # a draft's row, taken back
            pieces.truncate(p)
            split.append(pieces.run([int(ids[p + 1])], h[p:p + 1]))
        # the second layer, in a training forward (each layer has its own fusion)
        second = model.mtp(model.embed_tokens(ids[None, 1:]), h[None, :-1],
                           Context.train(ids[None, 1:]), layer=1)[0]
    assert rel(got, want[0]) <= 1e-4, rel(got, want[0])
    assert rel(torch.cat(split), want[0]) <= 1e-4
    assert rel(second, want[1]) <= 1e-4


def test_mtp_layers_export_back_and_draft(saved, tmp_path, capsys):
    import dataclasses

    from safetensors.torch import load_file

    from hyla.cli.main import main
    from hyla.model.formats.families.mimo_v2_flash import FAMILY

    ref, path = saved
    src = with_mtp(path, tmp_path / "mtp", mtp_parts(ref))
    model, tok = load_model(src)
    # the CLI's export keeps them, says nothing of leaving them out, and counts them
    assert main(["export", str(src), str(tmp_path / "cli")]) == 0
    said = capsys.readouterr().out
    assert "left out" not in said and f"{model.num_parameters():,} parameters" in said
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    out = tmp_path / "out"       # transformers still reads it (leaving model.mtp.* out)
    check_export(model, tok, out, transformers, ref, ids)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    assert "model.mtp.layers.1.pre_mlp_layernorm.weight" in load_file(out / "model.safetensors")
    with pytest.raises(ValueError, match="mtp_options"):
        FAMILY.from_config(dataclasses.replace(model.cfg, mtp_options={}))
    # greedy output with MTP drafts is the model's own
    eng = Engine(model, None, EngineConfig(max_model_len=96, block_size=4))
    spec = Engine(model, None, EngineConfig(max_model_len=96, block_size=4, speculative="mtp",
                                            num_speculative_tokens=3))
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = ids[0].tolist()
    (plain,), (drafted,) = eng.generate([prompt], greedy), spec.generate([prompt], greedy)
    assert drafted.output_ids == plain.output_ids
    assert spec.stats["draft_tokens"] > 0


def test_partial_mtp_layers_refused_by_name(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    ref, path = saved
    dest = with_mtp(path, tmp_path / "partial", mtp_parts(ref, n=1))
    w = load_file(dest / "model.safetensors")
    del w["model.mtp.layers.0.hnorm.weight"]
    w["model.mtp.layers.0.proj.weight"] = torch.zeros(2, 2)
    save_file(w, dest / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.mtp.layers.0.hnorm.weight"):
        load_model(dest)


def test_missing_fields_read_as_transformers_reads_them(saved):
    from hyla.model.formats.families.mimo_v2_flash import FAMILY

    _, path = saved
    hf = json.loads((path / "config.json").read_text())
    for key in ("attention_value_scale", "layer_types", "mlp_layer_types"):
        del hf[key]
    hf["num_hidden_layers"], hf["sliding_window_size"] = 7, 4
    theirs = reference("mimo_v2_flash").MiMoV2FlashConfig(**hf)
    cfg = FAMILY.to_config(hf, "config.json")
    slides = [cfg.layer_config(i).sliding_window for i in range(7)]
    assert slides == [theirs.sliding_window if t == "sliding_attention" else None
                      for t in theirs.layer_types] and theirs.sliding_window == 5
    assert cfg.ffn_layers == "".join("E" if m == "sparse" else "S"
                                     for m in theirs.mlp_layer_types)
    assert cfg.mixer_options["attention"]["value_scale"] == theirs.attention_value_scale


@pytest.mark.parametrize("name", ["model.mtp.layers.0.eh_proj.weight",
                                  "model.layers.1.self_attn.q_proj.weight"])
def test_a_wrong_shape_is_named_as_the_file_names_it(saved, tmp_path, name):
    from safetensors.torch import load_file, save_file

    ref, path = saved
    dest = with_mtp(path, tmp_path / "shape", mtp_parts(ref, n=1))
    w = load_file(dest / "model.safetensors")
    w[name] = w[name][:-1].contiguous()
    save_file(w, dest / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor {re.escape(name)} \(hyla's .*\) has shape"):
        load_model(dest)


def test_two_names_for_one_tensor_refused(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    ref, path = saved
    dest = with_mtp(path, tmp_path / "both", mtp_parts(ref, n=1))
    w = load_file(dest / "model.safetensors")
    w["model.mtp.layers.0.post_attention_layernorm.weight"] = \
        w["model.mtp.layers.0.pre_mlp_layernorm.weight"] + 1
    save_file(w, dest / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="both .*post_attention_layernorm.* and .*"
                                         "pre_mlp_layernorm"):
        load_model(dest)


@pytest.mark.parametrize("claimed", [3, "two"])
def test_the_config_mtp_count_is_checked_against_the_tensors(saved, tmp_path, caplog,
                                                             claimed):
    ref, path = saved
    dest = with_mtp(path, tmp_path / "count", mtp_parts(ref, n=2))
    cfg = json.loads((dest / "config.json").read_text()) | {"num_nextn_predict_layers": claimed}
    (dest / "config.json").write_text(json.dumps(cfg))
    if isinstance(claimed, str):
        with pytest.raises(ValueError, match="num_nextn_predict_layers='two' must be an int"):
            load_model(dest)
        return
    with caplog.at_level("WARNING"):
        model, _ = load_model(dest)
    assert model.cfg.mtp_layers == 2
    assert "num_nextn_predict_layers=3, but 2 multi-token-prediction layer(s)" in caplog.text


def test_compiled_decode_builds_and_equals_eager(saved, caplog):
    """torch 2.13's module-guard filter raised KeyError ('sinks', 'gate_proj') on MiMo's
    blocks of several kinds with an MoE graph break: the warm-up builds again with every
    guard, and the compiled tokens are the eager ones."""
    _, path = saved
    model, _ = load_model(path)
    common = dict(max_model_len=64, block_size=4, decode_widths=(1,), max_num_seqs=1)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = list(range(1, 12))
    (want,) = Engine(model, None, EngineConfig(**common)).generate([prompt], greedy)
    eng = Engine(model, None, EngineConfig(**common, compile=True))
    with caplog.at_level("WARNING"):
        eng.warmup()
    (got,) = eng.generate([prompt], greedy)
    assert got.output_ids == want.output_ids and eng.runner.num_compilations > 0
    assert eng.runner.skip_module_guards is ("every guard" not in caplog.text)


def test_a_window_mtp_state_stays_bounded_and_exact(saved, tmp_path):
    """A window layer's MTP state forgets rows a window before each length it keeps: run in
    random pieces with drafts taken back, from a small buffer, it gives the outputs of one
    run, and its buffer stays a few windows long; a truncate below what it forgot is
    refused."""
    import random

    from hyla.model.mtp import MTPState

    ref, path = saved
    model, _ = load_model(with_mtp(path, tmp_path / "mtp", mtp_parts(ref, n=1)))
    n = 120
    ids = torch.randint(0, VOCAB, (n + 1,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        h = model(ids[None], hidden=True)[0]
        want = MTPState(model, capacity=512).run(ids[1:].tolist(), h[:-1])
        st, got, p, rng = MTPState(model, capacity=8), [], 0, random.Random(0)
        while p < n:
            m = min(n - p, rng.randint(1, 12))
            got.append(st.run(ids[p + 1:p + m + 1].tolist(), h[p:p + m]))
            p += m
            for _ in range(rng.randint(0, 3)):          # drafts, taken back
                st.run([rng.randrange(VOCAB)], h[p - 1:p])
            st.truncate(p)
    assert rel(torch.cat(got), want) <= 1e-5
    assert st.forgotten > 0 and st.capacity <= 4 * (WINDOW + 12)
    with pytest.raises(ValueError, match="forgets rows"):
        st.truncate(st.forgotten)

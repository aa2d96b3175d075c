"""Checks the MLA + KDA + MoE families (Kimi Linear, Ring-2.5) share: a small random
transformers model with every norm, bias, gate, A_log, dt_bias and router bias randomised,
saved with a tokenizer; hyla's logits, greedy tokens, prefill + decode, prefix cache and
export against it."""

from __future__ import annotations

import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))    # tests/model: layer_checks
from family_checks import check_export as check_family_export  # noqa: E402
from family_checks import edit_config, rel, save, tensors  # noqa: E402,F401
from layer_checks import (  # noqa: E402
    check_engine_greedy_matches_model_loop,
    check_prefill_only_hand_over,
    check_prefix_cache_snapshots,
)
from safetensors.torch import save_file

from hyla.model import load_model
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.sequence import SamplingParams

VOCAB = 300
MOE = dict(moe_intermediate_size=16, num_local_experts=8, num_experts_per_tok=3, n_group=2,
           topk_group=1, n_shared_experts=2, routed_scaling_factor=1.7)
MLA = dict(kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, pad_token_id=None,
             eos_token_id=None, tie_word_embeddings=False, **MLA, **MOE)


def randomise(model, seed: int = 0):
    """Every norm weight, bias, A_log, dt_bias and router bias away from its init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith(("bias", "A_log")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.eval()








def check_logits_and_steps(ref, path) -> tuple[object, object, float, float]:
    """load_model's logits == transformers' on 2 sequences; prefill in chunks + batched
    decode == forward. Returns (model, tokenizer, logits error, steps error)."""
    model, tok = load_model(path)
    ids = torch.randint(0, VOCAB, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids).logits
    err = rel(ours, theirs)
    st, other = model.new_state(), model.new_state()
    steps = [model.prefill(ids[0, :3], st), model.prefill(ids[0, 3:50], st)]
    model.prefill(ids[1, :9], other)
    steps += [model.decode(torch.stack([ids[0, t], ids[1, 9]]), [st, other])[:1]
              for t in range(50, 70)]
    return model, tok, err, rel(torch.cat(steps), ours[0])


def check_generate_matches_transformers(model, ref) -> None:
    """The engine's greedy tokens (prompts batched, chunked prefill) == transformers'
    ``generate``, one prompt at a time."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 23, 41)]
    want = [ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    eng = Engine(model, None, EngineConfig(max_model_len=96, max_num_batched_tokens=32))
    got = eng.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [s.output_ids for s in got] == want


def check_engine(model) -> None:
    check_engine_greedy_matches_model_loop(model, 4, max_num_batched_tokens=24,
                                           snapshot_interval=16, max_num_seqs=3)
    check_prefix_cache_snapshots(model, 5)
    check_prefill_only_hand_over(model, 6)


def check_state_bytes(model, config, n: int = 37) -> None:
    """A sequence's state is the family's own arithmetic: MLA layers keep the compressed
    latent (kv_lora_rank + qk_rope_head_dim a token, model dtype), KDA layers an [H, d, d]
    float32 matrix and the three short convs' last kernel - 1 inputs."""
    st = model.new_state()
    model.prefill(torch.arange(n) % VOCAB, st)
    c, item = config, model.embed.weight.dtype.itemsize
    mla = n * (c.kv_lora_rank + c.qk_rope_head_dim) * item
    kda = (c.linear_num_heads * c.linear_head_dim ** 2 * 4
           + (c.linear_conv_kernel_dim - 1) * 3 * c.linear_num_heads * c.linear_head_dim * item)
    kinds = c.layer_types
    assert st.nbytes == mla * kinds.count("full_attention") + kda * kinds.count(
        "linear_attention")


def check_export(model, tok, src, out, transformers, ref) -> None:
    """Export writes the family's own files: the same tensors (names, shapes, bits) as
    transformers saved, read back bit for bit, equal logits in transformers."""
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(7))
    check_family_export(model, tok, out, transformers, ref, ids, tol=1e-5)
    mine, theirs = tensors(out), tensors(src)
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def add_mtp_layer(path, n_layers: int, field: str) -> None:
    """Append a multi-token-prediction layer's tensors (as the released checkpoints store
    them, after the decoder) and declare it in config.json."""
    weights = tensors(path)
    prefix = f"model.layers.{n_layers - 1}."
    weights |= {k.replace(prefix, f"model.layers.{n_layers}."): v.clone()
                for k, v in weights.items() if k.startswith(prefix)}
    weights[f"model.layers.{n_layers}.eh_proj.weight"] = torch.zeros(4, 4)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = 1
    (path / "config.json").write_text(json.dumps(cfg))


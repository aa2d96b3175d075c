"""Qwen3-Next / Qwen3.5 multi-token-prediction layers (``mtp.*``): loaded, not dropped;
their arithmetic equals a reference built from transformers' own modules (its decoder layer
for a full-attention layer, its zero-centred RMSNorm) on the fusion vLLM runs for these
families; exported back with the config fields vLLM reads; a file without them loads a
model without them."""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import rel, save
from hf_reference import reference
from safetensors.torch import load_file, save_file
from test_qwen3_next import VOCAB, bpe, hf_model, ids_batch, randomise  # noqa: F401

from hyla.model import load_model
from hyla.model.mtp import MTPState

transformers = pytest.importorskip("transformers")


def mtp_reference(case: str, seed: int = 5):
    """(the transformers model, the MTP modules: fc, the three norms, and a decoder layer
    built as the last full-attention layer, which hyla's MTP layer copies)."""
    ref = hf_model(case)
    mod = reference("qwen3_next" if case == "qwen3_next" else "qwen3_5")
    cfg = ref.config
    d = cfg.hidden_size
    torch.manual_seed(seed)
    norm = getattr(mod, "Qwen3NextRMSNorm", None) or mod.Qwen3_5RMSNorm
    layer_cls = getattr(mod, "Qwen3NextDecoderLayer", None) or mod.Qwen3_5DecoderLayer
    last_attn = max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    parts = {"fc": torch.nn.Linear(2 * d, d, bias=False),
             "pre_fc_norm_embedding": norm(d, eps=cfg.rms_norm_eps),
             "pre_fc_norm_hidden": norm(d, eps=cfg.rms_norm_eps),
             "norm": norm(d, eps=cfg.rms_norm_eps),
             "layers.0": layer_cls(cfg, last_attn)}
    for m in parts.values():
        m.eval()
        with torch.no_grad():   # a module built alone is not initialised (experts: torch.empty)
            for p in m.parameters():
                p.normal_(0.0, 0.05)
        randomise(m, seed)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "norm" in name or isinstance(m, norm):
                    p.normal_(0.0, 0.3)
    return ref, parts


def save_with_mtp(ref, parts, path, bpe_):
    save(ref, path, bpe_)
    w = load_file(path / "model.safetensors")
    for name, m in parts.items():
        for k, v in m.state_dict().items():
            w[f"mtp.{name}.{k}"] = v.contiguous()
    save_file(w, path / "model.safetensors")
    return path


@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_5_text"])
def test_mtp_matches_transformers_modules(tmp_path, bpe, case):  # noqa: F811
    ref, parts = mtp_reference(case)
    model, _ = load_model(save_with_mtp(ref, parts, tmp_path / case, bpe))
    assert model.cfg.mtp_layers == 1 and model.mtp is not None
    ids = ids_batch()[:1]
    T = ids.shape[1]
    with torch.no_grad():
        h = model(ids, hidden=True)[0]                   # the target's final hidden states
        emb = ref.model.embed_tokens(ids[:, 1:])
        x = parts["fc"](torch.cat([parts["pre_fc_norm_embedding"](emb),
                                   parts["pre_fc_norm_hidden"](h[None, :-1])], dim=-1))
        pos = torch.arange(T - 1)[None]
        y = parts["layers.0"](x, position_embeddings=ref.model.rotary_emb(x, pos),
                              attention_mask=None, position_ids=pos)
        want = parts["norm"](y[0] if isinstance(y, tuple) else y)[0]
        state = MTPState(model)
        got = state.run(ids[0, 1:].tolist(), h[:-1])
        # and in pieces, as drafting feeds it: a chunk, then one pair at a time
        pieces = MTPState(model)
        split = [pieces.run(ids[0, 1:20].tolist(), h[:19])]
        split += [pieces.run([int(ids[0, p + 1])], h[p:p + 1]) for p in range(19, T - 1)]
    assert rel(got, want) <= 1e-4, rel(got, want)
    assert rel(torch.cat(split), want) <= 1e-4


def test_mtp_exports_back(tmp_path, bpe):  # noqa: F811
    ref, parts = mtp_reference("qwen3_next")
    model, tok = load_model(save_with_mtp(ref, parts, tmp_path / "in", bpe))
    from family_checks import check_export

    out = tmp_path / "out"      # (transformers reads it, leaving mtp.* out)
    check_export(model, tok, out, transformers, ref, ids_batch())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    # check_export compared every tensor, mtp.* too, after a round trip; the file names
    # them as the family does (experts one module each, as the stack's)
    w_out = load_file(out / "model.safetensors")
    assert {"mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight",
            "mtp.layers.0.mlp.experts.0.gate_proj.weight"} <= set(w_out)


def test_without_mtp_tensors_no_mtp(tmp_path, bpe):  # noqa: F811
    """transformers' save_pretrained leaves mtp.* out: the model loads without them, even
    when config.json names MTP layers, and --speculative mtp says why it cannot run."""
    path = save(hf_model("qwen3_5_text"), tmp_path / "plain", bpe)
    cfg = json.loads((path / "config.json").read_text()) | {"mtp_num_hidden_layers": 1}
    (path / "config.json").write_text(json.dumps(cfg))
    model, tok = load_model(path)
    assert model.cfg.mtp_layers == 0 and model.mtp is None
    from hyla.serve.engine import Engine, EngineConfig

    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        Engine(model, tok, EngineConfig(max_model_len=64, speculative="mtp"))


def test_partial_mtp_tensors_refused(tmp_path, bpe):  # noqa: F811
    path = save(hf_model("qwen3_5_text"), tmp_path / "partial", bpe)
    w = load_file(path / "model.safetensors")
    w["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(w, path / "model.safetensors")
    with pytest.raises(ValueError, match="mtp.fc.weight"):
        load_model(path)

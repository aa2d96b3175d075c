"""Tiny random transformers checkpoints of the hybrid families llama.cpp converts (LFM2,
Granite 4.0-H dense and MoE, Nemotron-H, Falcon-H1, Qwen3.5, Qwen3-Next with experts; every
norm, bias, A_log, D and dt_bias randomised), saved as llama.cpp's ``convert_hf_to_gguf.py``
wants them: for the GGUF tests and for ``benchmarks/llamacpp_greedy.py``.

``source_dir(name, d, seed)`` saves model ``name`` of :data:`MODELS` with SmolLM2's tokenizer
(one the converter recognises) and returns the transformers model; ``to_gguf`` converts it.
"""

from __future__ import annotations

import json
import pathlib

import torch
import transformers
from hf_reference import reference
from llama_cpp import convert

VOCAB = 49152       # SmolLM2's tokenizer: one the converter recognises


def randomise(model, seed: int):
    """Every norm, bias, D, A_log, dt_bias and router away from its init; embeddings and an
    untied head of unit scale, so that the top logits stand apart (at the init's 0.02 the
    first two differ by ~1e-4, and Q8_0 rounding picks either)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 1)
            elif name.endswith(("bias", ".D", "A_log", "router.weight", "gate.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        model.get_input_embeddings().weight.normal_(0.0, 1.0, generator=g)
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight.normal_(0.0, 1.0, generator=g)
    return model.eval()


def lfm2():
    return reference("lfm2").Lfm2ForCausalLM(transformers.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, block_multiple_of=32,
        layer_types=["conv", "full_attention", "conv", "full_attention"]))


def granite(experts: int):
    """Dense as Granite 4.0-H ships dense models (no experts used; llama.cpp sizes the
    FFN by intermediate_size, transformers by shared_intermediate_size: equal)."""
    return reference("granitemoehybrid").GraniteMoeHybridForCausalLM(
        transformers.GraniteMoeHybridConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=16 if experts else 24,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=experts, num_experts_per_tok=2 if experts else 0,
            shared_intermediate_size=24, mamba_n_heads=4,
            mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
            layer_types=["mamba", "attention", "mamba", "mamba"], embedding_multiplier=6.0,
            residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=3.0,
            position_embedding_type="nope"))


def nemotron():
    return reference("nemotron_h").NemotronHForCausalLM(transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        layers_block_type=["mamba", "mlp", "mamba", "attention", "mlp", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, layer_norm_epsilon=1e-5))


def falcon_h1():
    """The gated norm after the gate and no time-step limit, as llama.cpp computes the
    layer; muP multipliers away from 1 (the converter folds them into the weights)."""
    return reference("falcon_h1").FalconH1ForCausalLM(transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64,
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
        mamba_d_conv=4, mamba_rms_norm=True, mamba_norm_before_gate=False,
        rms_norm_eps=1e-5, embedding_multiplier=2.0, lm_head_multiplier=0.5,
        attention_in_multiplier=0.7, attention_out_multiplier=1.3, key_multiplier=0.6,
        ssm_in_multiplier=1.4, ssm_out_multiplier=0.8,
        ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9], mlp_multipliers=[0.8, 1.25],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}))


def nvidia_config(d: pathlib.Path) -> None:
    """config.json as NVIDIA ships Nemotron-H (a pattern string, no MoE fields). Its
    model_type renamed so that the converter reads the file as it is: through transformers'
    own config class it gains MoE defaults and is written as nemotron_h_moe with every MLP
    length 0, a file llama.cpp itself cannot run."""
    cfg = json.loads((d / "config.json").read_text())
    pattern = "".join({"linear_attention": "M", "full_attention": "*", "mlp": "-"}[t]
                      for t in cfg.pop("layers_block_type"))
    cfg = {k: v for k, v in cfg.items() if not any(
        w in k for w in ("expert", "moe", "mtp", "layer_types", "group", "topk", "routed",
                         "nextn")) or k == "n_groups"}
    cfg |= {"hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern),
            "model_type": "nemotron_h_nvidia"}
    (d / "config.json").write_text(json.dumps(cfg))


def qwen(module: str, cls: str, config: str, rope: dict | None = None, **moe):
    """Key and value heads of one size, as Qwen3.5 and Qwen3-Next ship (llama.cpp sizes
    both by ``ssm.state_size``)."""
    return getattr(reference(module), cls)(getattr(transformers, config)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-5, **moe,
        layer_types=["linear_attention", "full_attention"] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                         "partial_rotary_factor": 0.5, **(rope or {})}))


MODELS = {"lfm2": lfm2, "granite-dense": lambda: granite(0), "granite-moe": lambda: granite(4),
          "nemotron-h": nemotron,
          # Qwen3.5's multimodal rotary sections, sized to these heads' 8 rotary dims
          "qwen3.5": lambda: qwen("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
                                  {"mrope_section": [2, 1, 1], "mrope_interleaved": True}),
          "qwen3-next": lambda: qwen("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                                     num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=24, decoder_sparse_step=1,
                                     shared_expert_intermediate_size=32),
          "falcon-h1": falcon_h1}


def source_dir(name: str, d: pathlib.Path, seed: int):
    """Model ``name`` of :data:`MODELS`, randomised with ``seed``, saved in ``d`` with
    SmolLM2's tokenizer and the config.json the converter reads; the model back."""
    from hyla.model.formats.gguf.load import load_gguf_tokenizer
    from hyla.model.formats.hf.tokenizer import save_hf_tokenizer
    from hyla.model.names import resolve_name

    torch.manual_seed(seed)
    ref = randomise(MODELS[name](), seed)
    ref.save_pretrained(d)
    save_hf_tokenizer(load_gguf_tokenizer(resolve_name("smollm2")), d)
    if name.startswith("granite"):   # the converter finds attention by the names
        cfg = json.loads((d / "config.json").read_text())   # Granite 4.0-H ships
        cfg["layer_types"] = ["mamba", "attention", "mamba", "mamba"]
        (d / "config.json").write_text(json.dumps(cfg))
    if name == "nemotron-h":
        nvidia_config(d)
    return ref


def to_gguf(name: str, d: pathlib.Path, out: pathlib.Path, outtype: str = "f32"):
    """``d`` (from :func:`source_dir`) converted by llama.cpp to ``out``."""
    extra = ("--no-mtp",) if name.startswith("qwen") else ()   # no MTP layers here
    return convert(d, out, outtype, *extra)

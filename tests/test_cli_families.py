"""Every command that takes ``--checkpoint``, on the hybrid transformers families, as a user
runs them: a small random model of each family saved by transformers (sharded safetensors,
a tokenizer with special tokens and a chat template), then ``hyla generate`` (tokens ==
transformers' greedy ``generate``), ``hyla eval ppl`` (== transformers' own loss),
``hyla export`` (transformers loads it with equal logits), ``hyla memory``, and one real
``hyla serve`` driven by the official ``openai`` client. Broken directories (corrupt
config.json, a missing shard, a field hyla cannot represent) are one clean error line.

Commands run in-process through :func:`hyla.cli.main` (the parser and error handling the
``hyla`` script runs), and as real subprocesses where the process itself matters (serve,
the exit status of a refusal)."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import string
import subprocess
import sys
import time

import pytest
import torch
from hf_reference import reference

from hyla.cli import main

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

VOCAB = 300
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "Hello world, the quick brown fox. def f(x):\n    return x + 1\n"
PROMPT = "def f(x):"
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, rms_norm_eps=1e-5, tie_word_embeddings=False,
            eos_token_id=2, pad_token_id=0)      # <|im_end|>, <|endoftext|>: see `tokenizer`
LIN = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
MLA = dict(kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
           num_key_value_heads=4, moe_intermediate_size=16, num_local_experts=8,
           num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=2,
           routed_scaling_factor=1.7, mlp_layer_types=["dense", "sparse", "sparse", "dense"])
QWEN = dict(num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_conv_kernel_dim=4, layer_types=LIN,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                             "partial_rotary_factor": 0.5})
FAMILIES = {   # name: (modeling module, model class, config class, config kwargs)
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig", QWEN | dict(
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen3_5_text": ("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", QWEN),
    "kimi_linear": ("kimi_linear", "KimiLinearForCausalLM", "KimiLinearConfig", MLA | dict(
        q_lora_rank=16, layer_types=LIN, linear_head_dim=16, linear_num_heads=4,
        linear_conv_kernel_dim=3, bos_token_id=None)),
    "bailing_hybrid": ("bailing_hybrid", "BailingHybridForCausalLM", "BailingHybridConfig",
                       MLA | dict(q_lora_rank=None, head_dim=16, layer_group_size=2,
                                  short_conv_kernel_size=3, num_mtp_layers=0,
                                  max_position_embeddings=128,
                                  rope_parameters={"rope_type": "default",
                                                   "rope_theta": 500.0})),
    "mimo_v2_flash": ("mimo_v2_flash", "MiMoV2FlashForCausalLM", "MiMoV2FlashConfig", dict(
        num_key_value_heads=1, head_dim=24, v_head_dim=16, sliding_window=7,
        attention_value_scale=0.7, attention_bias=True,
        layer_types=["full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"], mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e4,
                               "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.5}})),
    "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridForCausalLM",
                         "GraniteMoeHybridConfig", dict(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=48, layer_types=["mamba", "attention", "mamba", "mamba"],
        mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, embedding_multiplier=6.0,
        residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=3.0,
        position_embedding_type="nope")),
    "lfm2": ("lfm2", "Lfm2ForCausalLM", "Lfm2Config", dict(
        num_key_value_heads=2, norm_eps=1e-5, conv_L_cache=3, block_multiple_of=32,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM", "NemotronHConfig", dict(
        num_key_value_heads=2, head_dim=16, layer_norm_epsilon=1e-5, mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, time_step_min=0.01,
        layers_block_type=["mamba", "mlp", "mamba", "attention", "mlp"])),
    "falcon_h1": ("falcon_h1", "FalconH1ForCausalLM", "FalconH1Config", dict(
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=2, mamba_rms_norm=True, embedding_multiplier=2.0,
        key_multiplier=0.6, ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9],
        rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "olmo_hybrid": ("olmo_hybrid", "OlmoHybridForCausalLM", "OlmoHybridConfig", dict(
        num_key_value_heads=2, attention_bias=True, layer_types=LIN, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=24,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
}


def tokenizer(path):
    """A byte-level BPE of exactly VOCAB ids, all printable ASCII but the chat specials
    (ids 0-2; <|im_end|> is the config's EOS), so every token decodes to its own text and
    equal text means equal tokens; its config and a chat template, read by AutoTokenizer
    and hyla alike."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = " ".join("".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(2, 7)))
                     for _ in range(400))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 20 + [string.printable, words], trainer=trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False))
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id("<|im_end|>") == BASE["eos_token_id"]
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT}))


def randomise(model, seed):
    """Every norm, bias, sink, A_log, dt_bias, router weight and bias away from its init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith(("bias", "sinks", "A_log")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        # embeddings and head of unit / 0.2 scale: at the init's 0.02 the norms' weights set
        # the output, and greedy text repeats one token whatever the prompt
        model.get_input_embeddings().weight.normal_(0.0, 1.0, generator=g)
        model.get_output_embeddings().weight.normal_(0.0, 0.2, generator=g)
    return model.eval()


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """{family: (transformers reference model, its saved directory)}, built once."""
    out = {}
    for i, (name, (module, cls, config_cls, kw)) in enumerate(FAMILIES.items()):
        mod = reference(module)                # transformers on its pure-PyTorch path
        config = getattr(transformers, config_cls)(**(BASE | kw))
        torch.manual_seed(i)
        ref = randomise(getattr(mod, cls)(config), i)
        path = tmp_path_factory.mktemp(name)
        ref.save_pretrained(path, max_shard_size="100KB")          # sharded, with an index
        tokenizer(path)
        out[name] = ref, path
    return out


@pytest.fixture(scope="module")
def hf_tok(family_dirs):
    return transformers.AutoTokenizer.from_pretrained(family_dirs["qwen3_next"][1])


def hyla(capsys, *argv):
    """(exit status, stdout, stderr) of ``hyla argv`` run in-process."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def greedy(ref, tok, ids, n=8):
    """transformers' greedy continuation of ``ids`` (attention_mask given: else generate
    masks prompt tokens equal to pad_token_id): (text, token strings, their logprobs)."""
    ids = torch.tensor([ids])
    r = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                     do_sample=False, output_logits=True, return_dict_in_generate=True)
    new = r.sequences[0, ids.shape[1]:].tolist()
    lps = [float(torch.log_softmax(x[0].float(), -1)[t])
           for x, t in zip(r.logits, new, strict=True)]
    if new and new[-1] == ref.config.eos_token_id:      # hyla leaves the stop token out
        new, lps = new[:-1], lps[:-1]
    # specials read as '' in hyla's logprobs, as in its text (skip_special_tokens)
    text = [tok.decode([t], skip_special_tokens=True) for t in new]
    return tok.decode(new, skip_special_tokens=True), text, lps


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_ppl_export_memory(capsys, tmp_path, family_dirs, hf_tok, family):
    ref, path = family_dirs[family]
    assert len(list(path.glob("model-*.safetensors"))) > 1        # the sharded layout
    code, out, err = hyla(capsys, "generate", "--checkpoint", path, "--prompt", PROMPT,
                          "--temperature", 0, "--max-tokens", 8)
    assert code == 0, err
    assert out == PROMPT + greedy(ref, hf_tok, hf_tok(PROMPT).input_ids)[0] + "\n"

    data = tmp_path / "text.txt"
    data.write_text(TEXT * 8)
    code, out, err = hyla(capsys, "eval", "ppl", "--checkpoint", path, "--data", data,
                          "--seq-len", 32, "--max-tokens", 128, "--json")
    assert code == 0, err
    got = json.loads(out)
    ids = hf_tok(TEXT * 8 + "\n").input_ids                      # one document + "\n"
    windows = torch.tensor(ids[:128]).view(4, 32)
    with torch.no_grad():
        want = ref(windows, labels=windows).loss.item()
    assert got["tokens"] == 4 * 31 and abs(got["loss"] - want) <= 1e-4 * want

    code, out, err = hyla(capsys, "export", "--format", "transformers", path, tmp_path / "hf")
    assert code == 0, err
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                             dtype=torch.float32).eval()
    assert type(back).__name__ == type(ref).__name__
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = back(ids).logits, ref(ids).logits
    assert float((a - b).norm() / b.norm()) <= 1e-5
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    chat = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(chat, tokenize=False) == hf_tok.apply_chat_template(
        chat, tokenize=False) and again.eos_token == "<|im_end|>"

    code, out, err = hyla(capsys, "memory", "--checkpoint", path, "--context", "1K", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["state_bytes"] > 0 and report["params"] == sum(
        p.numel() for p in ref.parameters())


@pytest.mark.parametrize("family", ["kimi_linear", "mimo_v2_flash", "lfm2",
                                    "granitemoehybrid", "nemotron_h", "falcon_h1"])
def test_needle_and_simulate(capsys, tmp_path, family_dirs, family):
    """The other commands that take a model: passkey retrieval (MLA / window caches over
    a 256-token context) and the PrfaaS simulation sized from the directory's config."""
    path = family_dirs[family][1]
    code, out, err = hyla(capsys, "eval", "needle", "--checkpoint", path, "--context", "256",
                          "--depths", "0,1", "--trials", 1, "--out", tmp_path)
    assert code == 0, err
    assert len(json.loads((tmp_path / "needle.json").read_text())) == 2
    code, out, err = hyla(capsys, "simulate", "--model", path, "--requests", 20,
                          "--no-search", "--rate", 1, "--seeds", 1)
    assert code == 0 and "prfaas" in out, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(family_dirs, tmp_path_factory):
    """``python -m hyla serve --checkpoint <qwen3_next dir>`` on a free port."""
    path = family_dirs["qwen3_next"][1]
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w+b")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "hyla", "serve", "--checkpoint", str(path), "--port", str(port),
         "--threads", "1", "--log-level", "warning", "--max-model-len", "256",
         "--max-num-seqs", "1"],   # one state slot: every request reuses the last one's
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"server exited ({proc.returncode}):\n{log.read().decode()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server did not come up in 90 s")
            time.sleep(0.2)
        yield base, path.name
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_serve_with_the_openai_client(server, family_dirs, hf_tok):
    base, name = server
    ref = family_dirs["qwen3_next"][0]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [name]
    prompt = hf_tok(PROMPT).input_ids
    text, tokens, lps = greedy(ref, hf_tok, prompt)
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                                  logprobs=1)
    assert r.choices[0].text == text and r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].logprobs.tokens == tokens
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(lps, abs=1e-4)

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    text, tokens, lps = greedy(ref, hf_tok, prompt)
    r = client.chat.completions.create(model=name, messages=chat, max_tokens=8, temperature=0,
                                       logprobs=True)
    assert r.choices[0].message.content == text and r.usage.prompt_tokens == len(prompt)
    assert [c.token for c in r.choices[0].logprobs.content] == tokens
    assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(lps, abs=1e-4)
    stream = client.chat.completions.create(model=name, messages=chat, max_tokens=8,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    # A one-token prompt is computed as a decode step: its state slot (the only one), which
    # the requests above left full, must start from zeros all the same.
    r = client.completions.create(model=name, prompt=[7], max_tokens=8, temperature=0)
    assert r.choices[0].text == greedy(ref, hf_tok, [7])[0]


def _broken(src, tmp_path, how):
    """A copy of the family directory ``src`` broken in one way; returns (path, needle the
    error must name)."""
    path = tmp_path / how
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    if how == "corrupt-config":
        (path / "config.json").write_text((path / "config.json").read_text()[:150])
        return path, "config.json is not valid JSON"
    if how == "missing-shard":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        shard = sorted(set(index["weight_map"].values()))[1]
        (path / shard).unlink()
        return path, shard
    changes, needle = {      # a field changed so that the file's tensors no longer fit, or
        # no family has it (Nemotron-H calls its MLP's activation mlp_hidden_act)
        "gelu": ({"mlp_hidden_act" if "mlp_hidden_act" in config else "hidden_act": "gelu"},
                 "hidden_act='gelu'"),
        "head-dim": ({"linear_key_head_dim": 9}, "do not fit the layout"),
        "tied-head": ({"tie_word_embeddings": True}, "lm_head.weight differs"),
        "topk-group-0": ({"topk_group": 0}, "topk_group must be > 0"),
        "no-shared-experts": ({"num_shared_experts": 0}, "holds weights although"),
    }[how]
    (path / "config.json").write_text(json.dumps(config | changes))
    return path, needle


HOSTILE = [("qwen3_next", "corrupt-config"), ("qwen3_next", "missing-shard"),
           ("kimi_linear", "missing-shard"), ("qwen3_next", "head-dim"),
           ("qwen3_next", "tied-head"), ("mimo_v2_flash", "tied-head"),
           ("olmo_hybrid", "tied-head"), ("kimi_linear", "topk-group-0"),
           ("mimo_v2_flash", "topk-group-0"), ("kimi_linear", "no-shared-experts"),
           ] + [(f, "gelu") for f in FAMILIES]


@pytest.mark.parametrize("family,how", HOSTILE)
def test_broken_directory_is_one_clean_error(capsys, tmp_path, family_dirs, family, how):
    path, needle = _broken(family_dirs[family][1], tmp_path, how)
    for argv in (["generate", "--checkpoint", path, "--prompt", "hi"],
                 ["eval", "ppl", "--checkpoint", path],
                 ["export", path, tmp_path / "out"]):
        code, out, err = hyla(capsys, *argv)
        assert code != 0 and "error" in err and needle in err.replace("\n", ""), err
        assert "Traceback" not in out + err
    assert not (tmp_path / "out").exists()


def test_refusal_from_the_real_script(tmp_path, family_dirs):
    """The installed entry point: exit status 2, one error, no traceback (serve too: it
    loads the model before it binds the port)."""
    path, needle = _broken(family_dirs["qwen3_next"][1], tmp_path, "missing-shard")
    r = subprocess.run([sys.executable, "-m", "hyla", "serve", "--checkpoint", str(path),
                        "--port", str(_free_port())], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and needle in r.stderr.replace("\n", "")
    assert "Traceback" not in r.stdout + r.stderr


def test_export_keeps_what_other_engines_read(capsys, tmp_path, family_dirs):
    """The source's context length and special token ids survive an export."""
    src = family_dirs["kimi_linear"][1]
    config = json.loads((src / "config.json").read_text())
    config |= {"max_position_embeddings": 1234, "pad_token_id": 3}
    path = tmp_path / "kimi"
    shutil.copytree(src, path)
    (path / "config.json").write_text(json.dumps(config))
    assert hyla(capsys, "export", path, tmp_path / "out")[0] == 0
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["max_position_embeddings"] == 1234 and out["pad_token_id"] == 3


def test_distill_refuses_a_teacher_it_cannot_start_from(capsys, tmp_path, family_dirs):
    code, _, err = hyla(capsys, "distill", "--teacher", family_dirs["mimo_v2_flash"][1],
                        "--layers", "GAGA", "--out", tmp_path / "run")
    assert code != 0 and "has mixer_options" in err.replace("\n", "")


def test_generation_config_end_ids_are_read(family_dirs):
    from hyla.model.formats.hf.tokenizer import load_hf_tokenizer

    path = family_dirs["qwen3_next"][1]
    gen = path / "generation_config.json"
    before = gen.read_text() if gen.is_file() else None
    gen.write_text(json.dumps({"eos_token_id": [2, 0, 7]}))
    try:
        tok = load_hf_tokenizer(path, VOCAB)
        assert tok.stop_ids == (0, 7) and tok.eos_id == 2
    finally:
        gen.write_text(before) if before is not None else gen.unlink()

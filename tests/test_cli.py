"""The `hyla` command, in-process (and once as a real subprocess)."""

import json
import subprocess
import sys

import pytest

from hyla.cli import main
from hyla.cli.common import format_bytes


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_memory_json_laplace(capsys):
    code, out, _ = run(capsys, "memory", "--preset", "laplace-3b", "--context", "8K", "--json")
    assert code == 0
    report = json.loads(out)  # exactly one JSON object on stdout
    for key in ("state_bytes", "kv_bytes", "ratio", "sequences_fit"):
        assert key in report
    assert 75 < report["ratio"] < 95
    assert abs(report["state_bytes"] - 29.5e6) / 29.5e6 < 0.10
    assert report["context"] == 8192
    assert report["sequences_fit"]["hybrid"] > 50 * report["sequences_fit"]["attention"]


def test_memory_table(capsys):
    code, out, _ = run(capsys, "memory", "--preset", "small", "--context", "4096",
                       "--budget-gib", "16")
    assert code == 0
    assert "GLA state" in out and "ratio" in out and "16 GiB" in out


@pytest.mark.parametrize("argv,needle", [
    (["memory", "--preset", "nope", "--context", "8K"], "unknown preset"),
    (["memory", "--preset", "debug", "--context", "8Q"], "context"),
    (["memory", "--preset", "debug", "--context", "0"], "context"),
    (["memory", "--preset", "debug", "--context", "8K", "--budget-gib", "-1"], "budget"),
    (["memory", "--preset", "debug"], "--context"),
    (["generate", "--preset", "debug", "--prompt", ""], "prompt"),
    (["generate", "--preset", "bogus", "--prompt", "hi"], "unknown preset"),
    (["frobnicate"], "invalid choice"),
    ([], "command"),
], ids=["preset", "context-junk", "context-zero", "budget", "missing", "empty-prompt",
        "gen-preset", "command", "none"])
def test_bad_input_is_a_clean_error(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code != 0
    assert needle in err and "error" in err
    assert "Traceback" not in err + out


def test_generate_is_seeded(capsys):
    argv = ["generate", "--preset", "debug", "--prompt", "Hi", "--max-tokens", "8", "--seed", "3"]
    code, first, _ = run(capsys, *argv)
    assert code == 0 and first.splitlines()[-1].startswith("Hi")
    assert run(capsys, *argv)[1] == first


def test_quickstart(capsys, tmp_path):
    import torch

    threads = torch.get_num_threads()
    code, out, _ = run(capsys, "quickstart", "--max-tokens", "4", "--preset", "debug",
                       "--steps", "2", "--out", str(tmp_path / "run"))
    assert code == 0
    assert "parameters" in out and "validation loss" in out
    assert "Preset debug" in out and "memory of debug" in out and "small" not in out
    assert "def fibonacci(n):" in out
    assert (tmp_path / "run" / "ckpt-000002" / "model.safetensors").is_file()
    assert f"hyla serve --checkpoint {tmp_path / 'run'}" in out
    assert "curl http://127.0.0.1:8000/v1/completions" in out and "from openai import" in out
    assert torch.get_num_threads() == threads  # restored


def test_info(capsys):
    code, out, _ = run(capsys, "info")
    assert code == 0 and "GFLOP/s" in out and "torch" in out


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0


def test_format_bytes():
    assert format_bytes(28_311_552) == "28.3 MB"
    assert format_bytes(2_415_919_104) == "2.42 GB"
    assert format_bytes(12) == "12 B"


def test_subprocess_smoke():
    proc = subprocess.run([sys.executable, "-m", "hyla.cli", "memory", "--preset", "debug",
                           "--context", "1K", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["context"] == 1024
    bad = subprocess.run([sys.executable, "-m", "hyla.cli", "memory", "--preset", "nope",
                          "--context", "1K"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_generate_from_a_checkpoint(tmp_path, capsys):
    from hyla.model import HylaLM, preset
    from hyla.model.formats.checkpoint import save_checkpoint

    save_checkpoint(HylaLM(preset("debug")), tmp_path)
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "hi",
                 "--max-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("hi")
    assert main(["generate", "--prompt", "hi"]) == 2


def test_eval_ppl_and_needle_on_a_checkpoint(tmp_path, capsys):
    from hyla.model import HylaLM, preset
    from hyla.model.formats.checkpoint import save_checkpoint

    save_checkpoint(HylaLM(preset("debug")), tmp_path / "ckpt")
    data = tmp_path / "d.txt"
    data.write_text("print('hello world')\n" * 40)
    assert main(["eval", "ppl", "--checkpoint", str(tmp_path / "ckpt"), "--data", str(data),
                 "--seq-len", "64", "--max-tokens", "512", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["tokens"] == 8 * 63 and r["perplexity"] > 1
    assert main(["eval", "needle", "--checkpoint", str(tmp_path / "ckpt"), "--context", "256",
                 "--depths", "0,1", "--trials", "1", "--out", str(tmp_path / "n")]) == 0
    records = json.loads((tmp_path / "n" / "needle.json").read_text())
    assert [r["depth"] for r in records] == [0.0, 1.0]
    assert (tmp_path / "n" / "needle.png").is_file()
    assert main(["eval", "needle", "--checkpoint", str(tmp_path / "nope")]) == 2


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--preset", "debug", "--checkpoint", "x"], "not allowed with"),
    (["serve", "--preset", "debug", "--compile", "--eager"], "not allowed with"),
    (["serve", "--preset", "debug", "--max-num-seqs", "0"], "positive"),
    (["serve", "--preset", "debug", "--port", "70000"], "port"),
    (["serve", "--checkpoint", "/nonexistent/ckpt"], "not found: /nonexistent/ckpt"),
], ids=["two-sources", "compile-eager", "seqs", "port", "checkpoint"])
def test_serve_bad_args(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err + out


def test_serve_loads_a_checkpoint(tmp_path):
    import argparse

    from rich.console import Console

    from hyla.cli.common import load_model
    from hyla.model import HylaLM, preset
    from hyla.model.formats.checkpoint import save_checkpoint

    save_checkpoint(HylaLM(preset("debug")), tmp_path / "mine")
    args = argparse.Namespace(checkpoint=str(tmp_path / "mine"), preset=None, device="cpu")
    model, tok, name = load_model(args, Console(quiet=True))
    assert name == "mine" and tok.decode(tok.encode("hi")) == "hi"


def test_serve_trains_the_quickstart_model_when_missing(tmp_path, monkeypatch):
    import argparse

    from rich.console import Console

    import hyla.cli.common
    from hyla.cli.common import QUICKSTART_DIR, load_model
    from hyla.model import HylaLM, preset
    from hyla.model.formats.checkpoint import save_checkpoint

    calls = []

    def fake_train(out, **kw):  # the real one takes minutes: same contract, a debug model
        calls.append(kw)
        save_checkpoint(HylaLM(preset("debug")), QUICKSTART_DIR)
        return QUICKSTART_DIR

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hyla.cli.common, "train_quickstart", fake_train)
    args = argparse.Namespace(checkpoint=None, preset=None, device="cpu")
    assert load_model(args, Console(quiet=True))[2] == "quickstart" and len(calls) == 1
    load_model(args, Console(quiet=True))          # there now: not trained again
    assert len(calls) == 1


def test_a_new_run_never_overwrites_one_already_saved(capsys, tmp_path):
    """train and distill into a directory that holds a run: refused, naming --resume (found
    by a newcomer: the old run's metrics and settings were replaced while its newer
    checkpoints stayed, so the directory then loaded the old model); and an --out that is
    a file is named in the error."""
    argv = ["train", "--preset", "debug", "--steps", "1", "--seq-len", "32", "--batch-size",
            "1", "--no-progress", "--vocab-size", "300", "--tokenizer-documents", "5"]
    run_dir = tmp_path / "run"
    assert run(capsys, *argv, "--out", str(run_dir))[0] == 0
    saved = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    for command in (argv, ["distill", "--teacher", str(run_dir), "--stage1-steps", "1"]):
        code, out, err = run(capsys, *command[:1], *command[1:], "--out", str(run_dir))
        assert code != 0 and "already holds a training run" in err and "--resume" in err, err
    # distill --resume of a train run: named as such (was "unusable: TypeError", status 0)
    code, _, err = run(capsys, "distill", "--resume", str(run_dir), "--no-progress")
    assert code == 2 and "not a checkpoint of hyla distill" in err, err
    code, _, err = run(capsys, "export", str(run_dir), str(run_dir), "--format", "fla")
    assert code != 0 and "already holds a training run" in err, err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == saved
    exported = tmp_path / "exported"
    assert run(capsys, "export", str(run_dir), str(exported), "--format", "fla")[0] == 0
    code, _, err = run(capsys, "export", str(run_dir), str(exported), "--format", "fla")
    assert code != 0 and "--overwrite" in err
    assert run(capsys, "export", str(run_dir), str(exported), "--format", "fla",
               "--overwrite")[0] == 0
    (tmp_path / "afile").write_text("hi")
    code, _, err = run(capsys, *argv, "--out", str(tmp_path / "afile"))
    assert code != 0 and str(tmp_path / "afile") in err and "Traceback" not in err


def test_an_infinite_learning_rate_is_refused(capsys, tmp_path):
    """--lr inf once trained to NaN and saved the NaN weights as the newest checkpoint."""
    code, _, err = run(capsys, "train", "--preset", "debug", "--steps", "1", "--lr", "inf",
                       "--out", str(tmp_path / "run"))
    assert code != 0 and "finite" in err and not (tmp_path / "run").exists()
    for flags, needle in ((["--clip", "nan"], "clip"), (["--warmup-steps", "-1"], "warmup")):
        code, _, err = run(capsys, "train", "--preset", "debug", "--steps", "1", *flags,
                           "--out", str(tmp_path / "other"))
        assert code != 0 and needle in err, err


def test_a_diverged_run_stops_and_keeps_its_last_good_checkpoint(capsys, tmp_path):
    """A loss that turns NaN stops the run before that step is saved (it once trained on
    and saved NaN weights as the newest checkpoint); a finished run resumed says so."""
    argv = ["train", "--preset", "debug", "--seq-len", "32", "--batch-size", "1",
            "--no-progress", "--vocab-size", "300", "--tokenizer-documents", "5",
            "--save-every", "1", "--out", str(tmp_path / "run")]
    code, _, err = run(capsys, *argv, "--steps", "4", "--lr", "1e30", "--muon-lr", "1e30")
    assert code != 0 and "diverged" in err and "--init" in err, err
    saved = sorted(p.name for p in (tmp_path / "run").glob("ckpt-*"))
    assert saved and all(p.name.startswith("ckpt-") for p in (tmp_path / "run").iterdir()
                         if p.is_dir())
    from hyla.model.load import load_model

    load_model(tmp_path / "run" / saved[-1])       # finite weights (non-finite are refused)
    good = tmp_path / "good"
    assert run(capsys, *argv[:-1], str(good), "--steps", "1")[0] == 0
    code, out, _ = run(capsys, "train", "--resume", str(good), "--no-progress")
    assert code == 0 and "already complete" in out and "nan" not in out


def test_no_tokens_timed_says_no_rate():
    """--max-tokens 0 printed "prompt 6 tokens at inf tok/s" (a newcomer's)."""
    from hyla.cli.chat import turn_line
    from hyla.cli.common import speed_line
    from hyla.model.stream import StreamTiming

    assert speed_line(1.0, StreamTiming(prompt_tokens=6)) == (
        "load 1.00 s, prompt 6 tokens, decode 0 tokens")
    line = turn_line({"history": 0, "fed": 31, "new": 0, "reread": True,
                      "timing": StreamTiming(prompt_tokens=31)})
    assert "inf" not in line and "nan" not in line

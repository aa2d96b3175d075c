"""Prepared weights: what ``--quantize`` made of a model, kept on disk so the next start skips
it.

Loading SmolLM2-135M's Q4_1 GGUF and quantising it for the CPU (dequantise 538 MB of fp32,
then requantise and pack every layer) takes 1.3 s of a 2.9 s server start on an Intel Xeon
(issue 49's target: 2 s). The result is 95 MB of packed tensors that depend only on the
file, the scheme and this machine. The first start writes them to an entry of the cache;
later starts build the quantised modules' skeleton on the meta device
(:func:`hyla.model.quantize.quantized_skeleton`, no computation) and fill it from the
entry's safetensors file.

An entry is a directory named by its key, a hash of:

- the source's files (path, size, modification time): an edited or replaced file misses;
- the ``--quantize`` and ``--dtype`` asked for;
- hyla's model code (the text of ``hyla/model``) and torch's version: a change to how
  layers are quantised or packed misses;
- the CPU features the layout depends on (the int4 packing's block, fbgemm's int8 products).

It holds ``weights.safetensors`` (tensors shared by a tied embedding and output layer
stored once), the tokenizer in the Hugging Face layout, and ``manifest.json`` (the config,
the scheme, the lines the first load printed, the weights' CRC-32). An entry that fails any
check (a truncated or corrupt file, a skeleton that does not match) is deleted with a
warning and the model loads from its source, writing a fresh entry: the cache can cost a
start its time, never its correctness. The newest :data:`MAX_ENTRIES` entries are kept.

The cache lives in ``$HYLA_WEIGHTS_CACHE`` (default ``~/.cache/hyla/prepared``);
``HYLA_WEIGHTS_CACHE=off`` turns it off, as does ``--no-weights-cache``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import zlib
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

FORMAT = 1
MAX_ENTRIES = 4
MANIFEST, WEIGHTS = "manifest.json", "weights.safetensors"
_CHUNK = 1 << 24
_MODEL_CODE = pathlib.Path(__file__).resolve().parent


def cache_root() -> pathlib.Path | None:
    """The cache's directory, or None where ``HYLA_WEIGHTS_CACHE=off``."""
    value = os.environ.get("HYLA_WEIGHTS_CACHE", "")
    if value.lower() in ("off", "0", "none"):
        return None
    return pathlib.Path(value).expanduser() if value else \
        pathlib.Path.home() / ".cache" / "hyla" / "prepared"


def source_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The files a source is read from: itself, or a directory's files (a training run's
    newest checkpoint's)."""
    from hyla.model.formats.checkpoint import latest_checkpoint

    if path.is_file():
        return [path]
    root = latest_checkpoint(path)
    return sorted(p for p in root.iterdir() if p.is_file())


def entry_key(path: pathlib.Path, quantize: str, variant: str = "") -> str:
    """The key of ``path`` (a resolved source) quantised as ``quantize`` (what was asked,
    ``auto`` included), ``variant``: anything else the prepared model depends on (the dtype
    asked for)."""
    from hyla.model.quantize import machine_layout

    h = hashlib.sha256()
    for p in sorted(_MODEL_CODE.rglob("*.py")):
        h.update(p.read_bytes())
    files = [(str(p.resolve()), st.st_size, st.st_mtime_ns)
             for p in source_files(path) for st in [p.stat()]]
    fields = {"format": FORMAT, "files": files, "quantize": quantize, "variant": variant,
              "code": h.hexdigest(), "torch": torch.__version__,
              "cpu": list(machine_layout())}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def _crc32(path: pathlib.Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _flat_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's tensors with every shared one stored once: (tensors, aliases: name ->
    the stored name holding the same tensor)."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, t in model.state_dict().items():
        sig = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               t.stride(), t.dtype)
        if sig in seen:
            aliases[name] = seen[sig]
            continue
        ptr = sig[0]
        # a different view of a stored tensor's memory: safetensors wants its own copy
        t = t.clone() if ptr in storages else t.contiguous()
        seen[sig], tensors[name] = name, t
        storages.add(ptr)
    return tensors, aliases


def save_entry(root: pathlib.Path, key: str, model: nn.Module, tokenizer, *,
               notes: list[str]) -> pathlib.Path:
    """Write ``model`` (quantised) and ``tokenizer`` as the entry ``key``; returns its
    directory. Written beside and renamed into place: a reader never sees half an entry."""
    from safetensors.torch import save_file

    from hyla.model.formats.hf.tokenizer import save_hf_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    final = root / key
    tmp = root / f".{key}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tensors, aliases = _flat_state(model)
        save_file(tensors, str(tmp / WEIGHTS))
        tok = {"saved": tokenizer is not None}
        if tokenizer is not None:
            ids = save_hf_tokenizer(tokenizer, tmp)
            stops = list(getattr(tokenizer, "stop_ids", ()))
            if stops:       # the ids besides eos that end a generation, as transformers has them
                (tmp / "generation_config.json").write_text(
                    json.dumps({"eos_token_id": [ids.get("eos_token_id"), *stops]}) + "\n",
                    encoding="utf-8")
        manifest = {"format": FORMAT, "config": model.cfg.to_dict(),
                    "scheme": model.quantized, "dtype": str(model.anchor.dtype).split(".")[-1],
                    "aliases": aliases, "notes": notes, "tokenizer": tok,
                    "source_quantization": getattr(model, "source_quantization", None),
                    "crc32": _crc32(tmp / WEIGHTS)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        try:
            os.rename(tmp, final)
        except OSError:             # another process wrote the same entry first: keep it
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _evict(root)
    return final


def _evict(root: pathlib.Path) -> None:
    entries = sorted((p for p in root.iterdir() if (p / MANIFEST).is_file()),
                     key=lambda p: (p / MANIFEST).stat().st_mtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        shutil.rmtree(old, ignore_errors=True)


def load_entry(root: pathlib.Path, key: str, device: str | torch.device = "cpu"):
    """(model, tokenizer, manifest) of the entry ``key``, or None where there is none.
    An entry that fails a check is deleted (logged): the caller loads from the source."""
    entry = root / key
    if not (entry / MANIFEST).is_file():
        return None
    try:
        model, tok, manifest = _read_entry(entry, device)
    except Exception as e:  # noqa: BLE001  (any damage to the entry: it is rebuilt)
        log.warning("prepared weights in %s unreadable (%s: %s): deleted; loading from the "
                    "source", entry, type(e).__name__, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    os.utime(entry / MANIFEST)         # recently used: kept by _evict
    return model, tok, manifest


def _read_entry(entry: pathlib.Path, device):
    from safetensors.torch import load_file

    from hyla.model.config import HylaConfig
    from hyla.model.formats.hf.tokenizer import load_hf_tokenizer
    from hyla.model.formats.skeleton import meta_model
    from hyla.model.quantize import quantized_skeleton

    manifest = json.loads((entry / MANIFEST).read_text(encoding="utf-8"))
    if manifest.get("format") != FORMAT:
        raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT}")
    if _crc32(entry / WEIGHTS) != manifest["crc32"]:
        raise ValueError(f"{WEIGHTS} fails its CRC-32")
    cfg = HylaConfig(**manifest["config"])
    model = meta_model(cfg).to(getattr(torch, manifest["dtype"]))
    quantized_skeleton(model, manifest["scheme"])
    tensors = load_file(str(entry / WEIGHTS), device=str(device))
    _fill(model, tensors, manifest["aliases"])
    model.eval().requires_grad_(False)
    if manifest.get("source_quantization") is not None:
        model.source_quantization = tuple(manifest["source_quantization"])
    tok = None
    if manifest["tokenizer"]["saved"]:
        tok = load_hf_tokenizer(entry, cfg.vocab_size)
    return model, tok, manifest


def _fill(model: nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """Put the saved tensors in the skeleton's places; ValueError where the two differ."""
    want = dict(model.named_parameters()) | dict(model.named_buffers())
    have = set(tensors) | set(aliases)
    if set(want) != have:
        extra, missing = sorted(have - set(want)), sorted(set(want) - have)
        raise ValueError(f"the saved tensors do not match the model: {missing[:3]} missing, "
                         f"{extra[:3]} unexpected")
    for name in want:
        t = tensors[aliases.get(name, name)]
        parent, _, leaf = name.rpartition(".")
        module = model.get_submodule(parent)
        old = want[name]
        if not old.is_meta:
            raise ValueError(f"{name} is no placeholder")
        if old.numel() and (old.shape != t.shape or old.dtype != t.dtype):
            raise ValueError(f"{name}: saved {tuple(t.shape)} {t.dtype}, the model has "
                             f"{tuple(old.shape)} {old.dtype}")
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[leaf] = t


def load_prepared(source: str | os.PathLike, quantize: str,
                  prepare: Callable[[], tuple[nn.Module, object, list[str]]], *,
                  variant: str = "", device: str | torch.device = "cpu", use: bool = True):
    """(model, tokenizer, notes, hit): ``source`` quantised as ``quantize`` asks, from the
    cache where it holds the entry, else from ``prepare()`` (which loads and quantises it and
    returns the lines it printed), saved for the next time when quantised. ``use`` False,
    a device other than the CPU, or a source that is no local path: ``prepare()`` alone."""
    from hyla.model.load import resolve_source

    root = cache_root() if use and torch.device(device).type == "cpu" and \
        quantize != "none" else None
    key = None
    if root is not None:
        try:
            key = entry_key(resolve_source(source), quantize, variant)
        except (OSError, ValueError):   # a hub id or a missing path: the loader says which
            key = None
    if key is not None:
        hit = load_entry(root, key, device)
        if hit is not None:
            model, tok, manifest = hit
            return model, tok, manifest["notes"], True
    model, tok, notes = prepare()
    if key is not None and getattr(model, "quantized", "none") != "none":
        try:
            save_entry(root, key, model, tok, notes=notes)
        except Exception as e:  # noqa: BLE001  (a full or read-only disk, as OSError or as
            # safetensors' own error: it costs the next start its time, never this one)
            log.warning("prepared weights not saved in %s: %s: %s", root, type(e).__name__, e)
    return model, tok, notes, False

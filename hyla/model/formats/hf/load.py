"""Loading a transformers directory (``config.json``, safetensors weights, ``tokenizer.json``)
as a :class:`~hyla.model.model.HylaLM`: an all-attention family through
:mod:`~hyla.model.formats.hf.config` and :mod:`~hyla.model.formats.hf.weights`, a hybrid one
through its :mod:`~hyla.model.formats.families` mapping."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib

import torch

from hyla.model.config import HylaConfig
from hyla.model.formats.families import FAMILIES
from hyla.model.formats.hf.config import HF_EXTRAS, hf_config_to_hyla
from hyla.model.formats.hf.tokenizer import load_hf_tokenizer
from hyla.model.formats.hf.weights import hf_state_to_hyla, read_safetensors
from hyla.model.model import HylaLM

log = logging.getLogger(__name__)


def load_hf(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
            device: str | torch.device = "cpu"):
    """Load a transformers causal-LM directory as (all-attention HylaLM in eval mode, tokenizer).

    Example:
        >>> import tempfile, tokenizers, transformers
        >>> path = tempfile.mkdtemp()
        >>> transformers.LlamaForCausalLM(transformers.LlamaConfig(
        ...     vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)
        >>> words = tokenizers.models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")
        >>> tokenizers.Tokenizer(words).save(f"{path}/tokenizer.json")
        >>> model, tok = load_hf(path)
        >>> model.cfg.layers, model.cfg.vocab_size, tok.encode("hi")
        ('AA', 64, [1])
    """
    root = pathlib.Path(path)
    if not (root / "config.json").is_file():
        raise ValueError(f"{root} has no config.json: expected a transformers model directory")
    source = str(root / "config.json")
    try:
        hf = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from e
    family = FAMILIES.get(hf.get("model_type")) if isinstance(hf, dict) else None
    if family is not None:
        cfg = family.to_config(hf, source)
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
        kept = {k: text.get(k, hf.get(k)) for k in HF_EXTRAS}
        cfg = dataclasses.replace(cfg, hf_extras={k: v for k, v in kept.items()
                                                  if v is not None})
        weights, where = read_safetensors(root, dtype), str(root / "model.safetensors")
        if family.fold is not None:
            weights = family.fold(weights, hf, where)
        origin = _origin(weights)
        state = family.to_state(weights, cfg, where)
        # the MTP layers the file holds (transformers writes none: it leaves mtp.* out)
        mtp = len({k.split(".")[2] for k in state if k.startswith("mtp.layers.")})
        _check_mtp_count(hf, mtp, source)
        cfg = dataclasses.replace(cfg, mtp_layers=mtp)
    else:
        cfg = hf_config_to_hyla(hf, source)
        weights = read_safetensors(root, dtype)
        origin = _origin(weights)
        state = hf_state_to_hyla(weights, cfg, str(root / "model.safetensors"))
    file_names = {k: origin[id(t)] for k, t in state.items() if id(t) in origin}
    return hyla_model_from(cfg, state, str(root), source, dtype=dtype, device=device,
                           file_names=file_names), \
        load_hf_tokenizer(root, cfg.vocab_size, required=False)


_MTP_COUNT_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def _check_mtp_count(hf: dict, loaded: int, source: str) -> None:
    """The MTP layer count config.json names (where it names one) is an int >= 0, and a
    count other than the tensors' is said: the tensors decide, as vLLM's loader's do."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    for key in _MTP_COUNT_FIELDS:
        n = text.get(key, hf.get(key))
        if n is None:
            continue
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{source}: {key}={n!r} must be an int >= 0")
        if n != loaded:
            log.warning("%s: %s=%d, but %d multi-token-prediction layer(s) loaded from the "
                        "tensors%s", source, key, n, loaded,
                        " (transformers' save_pretrained leaves them out; --speculative mtp "
                        "will not run)" if not loaded else "")


def _origin(weights: dict[str, torch.Tensor]) -> dict[int, str]:
    """Each tensor's name in the file, by identity: a converter that renames a tensor
    without changing it hands on the same object, so errors can name the file's name."""
    return {id(t): name for name, t in weights.items()}


def hyla_model_from(cfg: HylaConfig, state: dict[str, torch.Tensor], where: str, source: str,
                    *, dtype: torch.dtype, device, assign: bool = False,
                    file_names: dict[str, str] | None = None) -> HylaLM:
    """A HylaLM of ``cfg`` (eval mode) holding ``state`` (hyla names), every shape checked
    against the config on the meta device before any memory is allocated. ``assign``: the
    model takes ``state``'s own tensors (contiguous, ``dtype``, on ``device``, used nowhere
    else) rather than copies of them. ``file_names``: hyla name -> the file's, for errors."""
    from hyla.model.formats.skeleton import meta_model, to_empty

    model = meta_model(cfg)     # no init on meta: it would import torch._dynamo (seconds)
    want = model.state_dict()
    unknown = sorted(set(state) - set(want))
    if unknown:
        raise ValueError(f"{where}: tensors {unknown[:4]} have no place in the model {source} "
                         f"describes")
    for key, tensor in state.items():
        param = want[key]
        if param.shape != tensor.shape:
            theirs = (file_names or {}).get(key)
            name = f"{theirs} (hyla's {key})" if theirs and theirs != key else key
            raise ValueError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, "
                             f"{source} implies {tuple(param.shape)}")
    model = to_empty(model, device).to(dtype)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.load_state_dict(state, strict=not cfg.tie_embeddings, assign=assign)
    if cfg.tie_embeddings and assign:
        model.lm_head.weight = model.embed.weight
    return model.eval()

"""Prepared weights (hyla.model.prepared): a quantised model read back from the cache is the
model quantising gives, tensor for tensor and logit for logit; any change to the source, the
scheme or the code misses; a damaged entry is dropped and rebuilt, never served."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from hyla.model import HylaLM, preset
from hyla.model.formats.checkpoint import save_checkpoint
from hyla.model.load import load_model
from hyla.model.prepared import MANIFEST, MAX_ENTRIES, WEIGHTS, load_prepared
from hyla.model.quantize import quantize_model
from hyla.model.vnni_int8 import vnni_int8_available

SCHEMES = ["int8", "int4"] + (["int4-a8"] if vnni_int8_available() else [])


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("HYLA_WEIGHTS_CACHE", str(root))
    return root


def checkpoint(tmp_path, tie: bool = True):
    torch.manual_seed(0)
    cfg = preset("debug")
    cfg.tie_embeddings = tie
    return save_checkpoint(HylaLM(cfg), tmp_path / f"ckpt-tie{int(tie)}")


def prepared(path, scheme, calls=None):
    def prepare():
        if calls is not None:
            calls.append(1)
        model, tok = load_model(path)
        quantize_model(model, scheme)
        return model, tok, [f"quantised to {scheme}"]
    return load_prepared(path, scheme, prepare)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_cached_model_is_the_quantised_model(tmp_path, cache, scheme, tie):
    path = checkpoint(tmp_path, tie)
    calls = []
    fresh, tok, notes, hit = prepared(path, scheme, calls)
    assert not hit and calls == [1] and len(list(cache.iterdir())) == 1
    again, tok2, notes2, hit = prepared(path, scheme, calls)
    assert hit and calls == [1] and notes2 == notes == [f"quantised to {scheme}"]
    assert again.quantized == fresh.quantized == scheme
    want, got = fresh.state_dict(), again.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
    # module for module: classes, and what forward reads besides the tensors
    for (n, a), (_, b) in zip(fresh.named_modules(), again.named_modules(), strict=True):
        assert type(a) is type(b), n
        for attr in ("activation_bits", "vnni_min_rows", "group", "in_features", "dtype"):
            assert getattr(a, attr, None) == getattr(b, attr, None), (n, attr)
    if tie:     # the tied output layer and embedding share their int8 codes again
        assert again.lm_head.qweight.data_ptr() == again.embed.qweight.data_ptr()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(fresh(ids), again(ids))
        assert torch.equal(fresh(ids[:, :1]), again(ids[:, :1]))      # decode-width rows
    assert type(tok2) is type(tok)
    assert not any(p.requires_grad for p in again.parameters())


def test_a_changed_source_scheme_or_variant_misses(tmp_path, cache):
    path = checkpoint(tmp_path)
    calls = []
    prepared(path, "int8", calls)
    prepared(path, "int4", calls)
    assert len(calls) == 2 and len(list(cache.iterdir())) == 2
    st = (path / "model.safetensors").stat()
    os.utime(path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    prepared(path, "int8", calls)
    assert len(calls) == 3
    prepared(path, "int8", calls)           # the edited file's own entry now
    assert len(calls) == 3
    load_prepared(path, "int8", lambda: pytest.fail("not prepared again"))
    _, _, _, hit = load_prepared(path, "int8", lambda: prepared_parts(path, "int8"),
                                 variant="bfloat16")
    assert not hit


def prepared_parts(path, scheme):
    model, tok = load_model(path)
    quantize_model(model, scheme)
    return model, tok, []


@pytest.mark.parametrize("damage", ["flip a weight byte", "truncate the weights",
                                    "break the manifest", "drop a tensor"])
def test_a_damaged_entry_is_dropped_and_rebuilt_never_served(tmp_path, cache, caplog, damage):
    path = checkpoint(tmp_path)
    fresh, _, _, _ = prepared(path, "int8")
    (entry,) = list(cache.iterdir())
    weights = entry / WEIGHTS
    if damage == "flip a weight byte":
        data = bytearray(weights.read_bytes())
        data[-100] ^= 0x40
        weights.write_bytes(bytes(data))
    elif damage == "truncate the weights":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "break the manifest":
        (entry / MANIFEST).write_text('{"format": 1, "conf', encoding="utf-8")
    else:       # a consistent entry whose tensors do not fit the model (CRC recomputed)
        import json
        import zlib

        from safetensors.torch import load_file, save_file

        tensors = load_file(str(weights))
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, str(weights))
        manifest = json.loads((entry / MANIFEST).read_text())
        manifest["crc32"] = zlib.crc32(weights.read_bytes())
        (entry / MANIFEST).write_text(json.dumps(manifest))
    calls = []
    with caplog.at_level(logging.WARNING, logger="hyla.model.prepared"):
        again, _, _, hit = prepared(path, "int8", calls)
    assert not hit and calls == [1]
    assert "unreadable" in caplog.text and "deleted" in caplog.text
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(fresh(ids), again(ids))
    _, _, _, hit = prepared(path, "int8", calls)      # rebuilt whole
    assert hit and calls == [1]


def test_off_unquantised_and_foreign_sources_are_never_cached(tmp_path, cache, monkeypatch):
    path = checkpoint(tmp_path)
    _, _, _, hit = load_prepared(path, "none", lambda: (load_model(path)[0], None, []))
    assert not hit and not cache.exists()
    monkeypatch.setenv("HYLA_WEIGHTS_CACHE", "off")
    prepared(path, "int8")
    assert not cache.exists()
    monkeypatch.setenv("HYLA_WEIGHTS_CACHE", str(cache))
    _, _, _, hit = load_prepared(path, "int8", lambda: prepared_parts(path, "int8"), use=False)
    assert not hit and not cache.exists()
    # a source that is no local path is the loader's to refuse, not the cache's
    with pytest.raises(ValueError, match="not found"):
        load_prepared(tmp_path / "missing", "int8", lambda: load_model(tmp_path / "missing"))


def test_the_newest_entries_are_kept(tmp_path, cache):
    paths = [save_checkpoint(HylaLM(preset("debug")), tmp_path / f"m{i}")
             for i in range(MAX_ENTRIES + 2)]
    for p in paths:
        prepared(p, "int8")
    assert len(list(cache.iterdir())) == MAX_ENTRIES
    calls = []
    prepared(paths[-1], "int8", calls)
    prepared(paths[0], "int8", calls)
    assert calls == [1]                 # the newest was kept, the oldest evicted

"""Converted GGUF weights are cached on disk: a second load reads them back instead of decoding,
gives the same model, and a changed model, variant or loader never reads a stale entry."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_engine.loading import gguf_loader, weight_cache
from tests.gguf_quantize import TINY_IDS, write_tiny_gguf
from tests.test_cpu_kernels import ext  # noqa: F401  (the built CPU kernels; missing is a failed setup)

Q = gguf.GGMLQuantizationType
QTYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "ffn_down": Q.Q8_0, "ffn_up": Q.Q5_0}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("DUET_WEIGHT_CACHE", raising=False)
    monkeypatch.delenv("DUET_WEIGHT_CACHE_GB", raising=False)
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)  # the tiny files count as big
    return tmp_path / "data" / "converted-weights"


@pytest.fixture
def decodes(monkeypatch) -> list[bool]:
    """One entry per real decode of a GGUF's tensors (the variant it decoded)."""
    calls: list[bool] = []
    real = gguf_loader.read_tensors

    def counted(path, tensors, dense, *rest):
        calls.append(dense)
        return real(path, tensors, dense, *rest)

    monkeypatch.setattr(gguf_loader, "read_tensors", counted)
    return calls


def params(model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def same(a, b) -> bool:
    pa, pb = params(a), params(b)
    return pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)


@pytest.mark.parametrize("dense", [True, False])
def test_second_load_reads_the_cache_and_gives_the_same_model(tmp_path, cache, decodes, dense):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtypes=QTYPES)
    first, _, info1 = gguf_loader.load_gguf(path, dense=dense)
    assert decodes == [dense] and len(list(cache.glob("*.safetensors"))) == 1
    second, _, info2 = gguf_loader.load_gguf(path, dense=dense)
    assert decodes == [dense], "the second load decoded the GGUF again"
    assert info1 == info2 and same(first, second)
    assert np.array_equal(np.array(first(TINY_IDS)), np.array(second(TINY_IDS)))


def test_variant_and_model_changes_are_new_entries(tmp_path, cache, decodes):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtypes=QTYPES)
    gguf_loader.load_gguf(path, dense=True)
    gguf_loader.load_gguf(path, dense=False)  # the other variant is its own entry
    assert decodes == [True, False]
    write_tiny_gguf(path, "llama", qtypes={**QTYPES, "attn_q": Q.Q8_0})  # a new model at the same path
    changed, _, _ = gguf_loader.load_gguf(path, dense=True)
    assert decodes == [True, False, True], "a changed file was served from the old entry"
    fresh, _, _ = gguf_loader.load_gguf(path, dense=True)
    assert decodes == [True, False, True] and same(changed, fresh)


def test_a_loader_change_is_a_new_entry(tmp_path, cache, decodes, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtypes=QTYPES)
    gguf_loader.load_gguf(path, dense=False)
    monkeypatch.setattr(weight_cache, "code_version", lambda: "a-fixed-decoder")
    gguf_loader.load_gguf(path, dense=False)
    assert decodes == [False, False]


def test_a_damaged_entry_is_rebuilt(tmp_path, cache, decodes):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtypes=QTYPES)
    good, _, _ = gguf_loader.load_gguf(path, dense=False)
    (entry,) = cache.glob("*.safetensors")
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # a torn file
    again, _, _ = gguf_loader.load_gguf(path, dense=False)
    assert decodes == [False, False] and same(good, again)
    third, _, _ = gguf_loader.load_gguf(path, dense=False)
    assert decodes == [False, False] and same(good, third)  # the rebuilt entry is whole


def test_off_small_files_and_the_size_cap(tmp_path, cache, decodes, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtypes=QTYPES)
    monkeypatch.setenv("DUET_WEIGHT_CACHE", "0")
    gguf_loader.load_gguf(path, dense=False)
    assert not cache.exists()
    monkeypatch.delenv("DUET_WEIGHT_CACHE")
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", path.stat().st_size + 1)
    gguf_loader.load_gguf(path, dense=False)
    assert not cache.exists()
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    gguf_loader.load_gguf(path, dense=False)
    (old,) = cache.glob("*.safetensors")
    gguf_loader.load_gguf(path, dense=True)
    (dense,) = set(cache.glob("*.safetensors")) - {old}
    # room for the two dense entries, not for all three: the least recently used one goes
    monkeypatch.setenv("DUET_WEIGHT_CACHE_GB", str(2.05 * dense.stat().st_size / 2**30))
    write_tiny_gguf(path, "llama", qtypes={**QTYPES, "attn_q": Q.Q8_0})
    gguf_loader.load_gguf(path, dense=True)
    entries = set(cache.glob("*.safetensors"))
    assert old not in entries and dense in entries and len(entries) == 2
    assert decodes == [False, False, False, True, True]


def test_an_unwritable_cache_only_costs_the_decode(tmp_path, cache, decodes, monkeypatch):
    blocker = tmp_path / "data"
    blocker.write_text("a file where the cache directory would go")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtypes=QTYPES)
    model, _, _ = gguf_loader.load_gguf(path, dense=False)
    assert decodes == [False]
    assert mx.all(mx.isfinite(model(TINY_IDS))).item()


def test_an_entry_larger_than_half_the_cap_is_kept_and_the_others_make_room(
    tmp_path, cache, decodes, monkeypatch
):
    """A 3B model's converted weights (2.1 GB) under a 4 GiB cap were once never kept (entries were
    capped at half the cache), so every start converted them again. An entry up to the whole cap is
    kept now; older entries go to make room, and one larger than the cap is not stored."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", qtypes=QTYPES)
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    gguf_loader.load_gguf(path, dense=False)
    (small,) = cache.glob("*.safetensors")
    gguf_loader.load_gguf(path, dense=True)
    (big,) = set(cache.glob("*.safetensors")) - {small}
    size = big.stat().st_size
    big.unlink()
    # room for the big entry alone (it is over half the cap): kept, the small one goes
    monkeypatch.setenv("DUET_WEIGHT_CACHE_GB", str(1.2 * size / 2**30))
    gguf_loader.load_gguf(path, dense=True)
    assert set(cache.glob("*.safetensors")) == {big}
    gguf_loader.load_gguf(path, dense=True)  # read back, not decoded again
    assert decodes == [False, True, True]
    # a cap below the entry: not stored
    big.unlink()
    monkeypatch.setenv("DUET_WEIGHT_CACHE_GB", str(0.9 * size / 2**30))
    gguf_loader.load_gguf(path, dense=True)
    assert not list(cache.glob("*.safetensors"))


@pytest.mark.skipif(mx.metal.is_available(), reason="the CPU kernels' scale passes run on the CPU")
def test_a_cached_model_loads_without_holding_its_unconverted_scales(tmp_path, cache, decodes, ext):  # noqa: F811
    """A cache hit is read as the CPU's passes convert it, layer by layer: the float32 scales and
    biases of a Q8_0 model (0.25 bytes a weight beside its 1-byte codes, where the model keeps 0.0625)
    never all sit in memory beside the codes, so the load's peak stays near the model's own size.
    Holding them all is 1.20x the model's bytes (the order before); the load measures 1.01x or 1.08x
    (two orders MLX evaluates the last pass's arrays in, the second with some layers' float32 scales
    still alive at the peak), so the bound is 1.12x."""
    import gc

    from mlx.utils import tree_flatten

    from mlx_engine.loading.loader import load_model

    path = tmp_path / "q8.gguf"
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
    write_tiny_gguf(
        path,
        "llama",
        qtypes=lambda name: Q.Q8_0 if name.split(".")[-2] in kinds else Q.F32,
        config={"num_hidden_layers": 8, "hidden_size": 256, "intermediate_size": 1024, "head_dim": 64},
    )
    first = load_model(str(path))  # decodes the GGUF and stores the entry
    del first
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    loaded = load_model(str(path))
    assert decodes == [False], "the second load decoded the GGUF again"
    held = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    # a float32 scale and bias per group, as the entry holds them
    unconverted = sum(v.size * 8 for k, v in tree_flatten(loaded.model.parameters()) if k.endswith("scales"))
    assert unconverted > 0.15 * held  # what holding them all would add: the bound below can fail
    assert mx.get_peak_memory() - before <= held * 1.12

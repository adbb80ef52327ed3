"""``check_gguf`` / ``duet doctor MODEL``: whether a GGUF will load, from its header alone, with the
verdict loading itself gives: files that load are reported with the model loading builds (its class,
parameter count, how each tensor type is held), files that do not are refused for the same reason."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_engine.errors import GGUFError
from mlx_engine.loading.gguf_check import HELD_BITS, check_gguf
from mlx_engine.loading.gguf_loader import load_gguf
from mlx_engine.loading.resolve import bundled_model_path
from tests.gguf_families import FAMILIES, MOE_FAMILIES, write_family_gguf
from tests.gguf_quantize import write_tiny_gguf

Q = gguf.GGMLQuantizationType


def _parameters(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def test_the_bundled_model_is_reported_as_it_loads():
    check = check_gguf(bundled_model_path())
    assert check.loads and check.reason is None
    model, tokenizer, info = load_gguf(bundled_model_path(), dense=True)
    assert check.model_class == f"mlx_lm.models.{info['model_type']}"
    assert check.parameters == _parameters(model)
    assert check.context_length == info["context_length"]
    assert check.tokenizer == f"gpt2 (pre smollm), {tokenizer.vocab_size} tokens"
    assert check.chat_template
    assert check.tensor_types == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert check.held_as["Q4_1"] == "4-bit affine, group 32, exact"


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_family_is_checked_against_the_model_it_builds(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_family_gguf(path, arch)
    check = check_gguf(path)
    assert check.loads, check.reason
    model, _, _ = load_gguf(path, dense=True)
    assert check.parameters == _parameters(model)
    assert check.model_class == f"mlx_lm.models.{FAMILIES[arch][0]}"
    if arch in MOE_FAMILIES:
        # 4 experts, 2 used: half the experts' weights are read per token
        experts = sum(
            v.size for k, v in tree_flatten(model.parameters()) if ".switch_mlp." in k or ".experts." in k
        )
        assert check.active_parameters == check.parameters - experts // 2
    else:
        assert check.active_parameters is None


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4])
def test_held_bits_are_what_loading_gives(tmp_path, qtype):
    path = tmp_path / f"{qtype.name}.gguf"
    write_tiny_gguf(path, "llama", qtypes={"ffn_up": qtype})
    model, _, _ = load_gguf(path, dense=False)
    layer = model.model.layers[0].mlp.up_proj
    assert layer.bits == HELD_BITS[qtype.name][0]
    assert check_gguf(path).loads


def _refusal(path) -> str:
    with pytest.raises(GGUFError) as e:
        load_gguf(path, dense=True)
    return str(e.value)


def test_a_file_that_will_not_load_is_refused_for_the_reason_loading_gives(tmp_path):
    unknown = tmp_path / "mamba.gguf"
    write_tiny_gguf(unknown, "llama", gguf_arch="mamba")
    odd = tmp_path / "odd.gguf"
    write_tiny_gguf(odd, "llama")
    data = bytearray(odd.read_bytes())
    at = data.index(b"llama.block_count") + len(b"llama.block_count") + 4
    data[at : at + 4] = (200).to_bytes(4, "little")
    odd.write_bytes(bytes(data))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(odd.read_bytes()[:4000])
    for path in (unknown, odd, truncated):
        check = check_gguf(path)
        assert not check.loads
        assert check.reason == _refusal(path)


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    path = tmp_path / "wide.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    src = gguf.GGUFReader(write_tiny_gguf(tmp_path / "ok.gguf", "llama") and tmp_path / "ok.gguf")
    for field in src.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind, field.types[-1] if kind == 9 else None)
    for t in src.tensors:
        data = np.array(t.data)
        if t.name == "blk.1.ffn_down.weight":
            data = np.concatenate([data, data], axis=1)  # twice the FFN width the metadata says
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    check = check_gguf(path)
    assert not check.loads
    assert "blk.1.ffn_down.weight has shape (64, 192)" in check.reason
    _refusal(path)  # and loading refuses it too


def test_duet_doctor_model(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "app.cli", "doctor", str(bundled_model_path()), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["ok"] and report["model"]["loads"] is True
    assert report["model"]["architecture"] == "llama"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    refused = subprocess.run(
        [sys.executable, "-m", "app.cli", "doctor", str(bad)], capture_output=True, text=True, timeout=300
    )
    assert refused.returncode == 1
    assert "loads:               no" in refused.stdout
    assert "bad.gguf is truncated or corrupt" in refused.stderr


def test_the_types_held_without_biases_are_the_symmetric_ones():
    """``SYMMETRIC`` (held_bytes: no biases on the CPU kernels) is exactly the types the loader
    decodes, and re-codes, with a fixed zero point."""
    from mlx_engine.loading.ggml_blocks import BLOCK_TYPES, Codes, decode, to_8bit_groups_of_32
    from mlx_engine.loading.gguf_check import SYMMETRIC
    from tests.gguf_quantize import random_blocks

    rng = np.random.default_rng(0)
    symmetric = set()
    for name, block in BLOCK_TYPES.items():
        raw = random_blocks(gguf.GGMLQuantizationType[name], 2, 1, rng)
        codes = decode(raw.reshape(-1), name, 2, block.weights)
        if isinstance(codes, Codes) and codes.group != 32:
            codes = to_8bit_groups_of_32(codes)
        if isinstance(codes, Codes) and codes.zero is not None:
            symmetric.add(name)
    assert symmetric == SYMMETRIC

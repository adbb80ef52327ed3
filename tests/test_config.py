"""Engine options are checked before anything is loaded or allocated (``EngineConfig.validate``),
and a model's files before it is loaded (``mlx_engine.loading.preflight.check_model``)."""

from __future__ import annotations

import json

import pytest

from mlx_engine.config import EngineConfig
from mlx_engine.errors import ConfigError, GGUFError, ModelLoadError, ModelNotFoundError
from mlx_engine.loading.preflight import check_model
from mlx_engine.loading.resolve import BUNDLED_NAME

GiB = 2**30
MEMORY = 16 * GiB  # a machine with 16 GiB, so the messages do not depend on this one


def flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def test_the_defaults_are_valid():
    EngineConfig().validate(MEMORY)
    EngineConfig(cache_gb=0.25, kv_bits=8, weights="dense", max_running=1).validate(MEMORY)
    EngineConfig(cache_fraction=0.9, kv_bits=4, kv_group_size=64).validate(MEMORY)
    EngineConfig(kv_dtype="float32").validate(MEMORY)


@pytest.mark.parametrize(
    "options, option, message",
    [
        ({"kv_bits": 3}, "kv_bits", "kv_bits must be 4 or 8, not 3"),
        (
            {"kv_dtype": "fp8"},
            "kv_dtype",
            "kv_dtype must be one of auto, float16, bfloat16, float32, not 'fp8'",
        ),
        ({"kv_bits": 8, "kv_dtype": "float32"}, "kv_dtype", "give kv_bits or kv_dtype, not both"),
        ({"kv_group_size": 16}, "kv_group_size", "kv_group_size must be 32, 64 or 128"),
        ({"weights": "fast"}, "weights", "weights must be one of auto, dense, quantized"),
        ({"block_size": 0}, "block_size", "block_size must be a positive integer, not 0"),
        ({"max_batch_tokens": -1}, "max_batch_tokens", "max_batch_tokens must be a positive integer"),
        ({"prefill_chunk": 2.5}, "prefill_chunk", "prefill_chunk must be a positive integer, not 2.5"),
        ({"max_running": 0}, "max_running", "max_running must be a positive integer, not 0"),
        ({"max_queue": True}, "max_queue", "max_queue must be a positive integer, not True"),
        ({"cache_gb": 0}, "cache_gb", "cache_gb must be above 0 GiB, not 0"),  # never "the default"
        ({"cache_gb": -2}, "cache_gb", "cache_gb must be above 0 GiB, not -2"),
        ({"cache_gb": float("nan")}, "cache_gb", "cache_gb must be a number, not nan"),
        ({"cache_gb": "2"}, "cache_gb", "cache_gb must be a number, not '2'"),
        ({"cache_gb": 1000}, "cache_gb", "cache_gb 1000 is more than this machine's 16.0 GiB of memory"),
        ({"cache_gb": 15}, "cache_gb", "cache_gb 15 is too much of this machine's 16.0 GiB of memory"),
        ({"cache_fraction": 0}, "cache_fraction", "cache_fraction must be above 0 and at most 0.9"),
        ({"cache_fraction": 0.95}, "cache_fraction", "at most 0.9 (a fraction of memory), not 0.95"),
        ({"cache_fraction": 2}, "cache_fraction", "cache_fraction must be above 0 and at most 0.9"),
        ({"cache_gb": 1, "cache_fraction": 0.3}, "cache_gb", "give cache_gb or cache_fraction, not both"),
        ({"disk_cache_dir": "/tmp/x", "disk_cache_gb": 0}, "disk_cache_gb", "disk_cache_gb must be above 0"),
    ],
)
def test_bad_options_are_one_line_config_errors(options, option, message):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**options).validate(MEMORY)
    assert e.value.option == option
    assert message in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)  # callers that catch ValueError keep working


def test_the_memory_limit_leaves_room_for_the_model():
    EngineConfig(cache_gb=14.4).validate(MEMORY)  # 90% of 16 GiB
    with pytest.raises(ConfigError, match=r"at most 14\.4 GiB, leaving room for the model"):
        EngineConfig(cache_gb=14.5).validate(MEMORY)


def test_messages_name_the_options_as_the_caller_spells_them():
    with pytest.raises(ConfigError, match=r"^--cache-gb 1000 is more than this machine's 16\.0 GiB"):
        EngineConfig(cache_gb=1000).validate(MEMORY, spell=flag)
    with pytest.raises(ConfigError, match="^give --cache-gb or --cache-fraction, not both$"):
        EngineConfig(cache_gb=1, cache_fraction=0.5).validate(MEMORY, spell=flag)


def test_the_machine_memory_is_looked_up_when_not_given():
    from mlx_engine.backend import total_memory_bytes

    gib = total_memory_bytes() / GiB
    with pytest.raises(ConfigError, match=f"this machine's {gib:.1f} GiB of memory"):
        EngineConfig(cache_gb=100_000).validate()


def test_kv_budget():
    assert EngineConfig(cache_gb=2).kv_budget_bytes(MEMORY) == 2 * GiB
    assert EngineConfig(cache_fraction=0.25).kv_budget_bytes(MEMORY) == 4 * GiB
    assert EngineConfig().kv_budget_bytes(MEMORY) == 0.15 * MEMORY  # min(4 GiB, 15%)
    assert EngineConfig().kv_budget_bytes(64 * GiB) == 4 * GiB


# --- the model, before it loads ---------------------------------------------------------------
def test_good_models_pass(tiny_dirs):
    assert check_model(None).name == BUNDLED_NAME  # the bundled GGUF: header and tensor table
    src = check_model(str(tiny_dirs("llama")))
    assert src.kind == "hf_dir" and src.path == tiny_dirs("llama")
    assert check_model(str(tiny_dirs("mistral"))).kind == "hf_dir"  # mlx-lm builds it as llama


def model_dir(tmp_path, config: str | dict):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    (d / "model.safetensors").write_bytes(b"")
    return d


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_type": "no_such_arch"}, "unsupported architecture 'no_such_arch'"),
        ({"model_type": "../llama"}, "unsupported architecture '../llama'"),
        ({"hidden_size": 8}, "names no model_type"),
        ("[1, 2]", "names no model_type"),
        ("{oops", "cannot read"),
    ],
)
def test_bad_model_directories(tmp_path, config, message):
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_model(str(model_dir(tmp_path, config)))


def test_bad_gguf_files(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model not found"):
        check_model(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        check_model(str(junk))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(GGUFError, match="truncated"):
        check_model(str(cut))

"""``--context-length`` / ``-c`` (mlx_engine/context_length.py, issue 33): less than the model's own
shrinks what a sequence may hold, and with it the KV budget the engine plans; more is allowed as far
as the model's RoPE scaling reaches (YaRN over its original context) and refused past it with a
clear error, before a request could run into positions the model never saw."""

from __future__ import annotations

import json

import pytest

from mlx_engine.config import EngineConfig
from mlx_engine.context_length import scaled_context
from mlx_engine.engine import Engine
from mlx_engine.errors import ConfigError
from tests.tiny_models import make_tiny_model_dir

TRAINED = 512
# a budget far above what 4 sequences at full context could fill: the context decides the KV budget
CONFIG = dict(cache_gb=0.5, max_running=4)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("ctx") / "plain", context=TRAINED)


@pytest.fixture(scope="module")
def yarn(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("ctx") / "yarn", context=TRAINED)
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": TRAINED,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def kv_budget(engine: Engine) -> int:
    s = engine.stats()
    return s.kv_blocks_total * s.kv_block_bytes


def test_half_the_context_halves_the_kv_budget_the_model_asks_for(plain):
    with Engine.load(str(plain), config=EngineConfig(**CONFIG)) as full:
        assert full.context_length == TRAINED
        whole = kv_budget(full)
    with Engine.load(str(plain), config=EngineConfig(context_length=TRAINED // 2, **CONFIG)) as half:
        assert half.context_length == TRAINED // 2
        assert kv_budget(half) * 2 == pytest.approx(whole, rel=0.02)  # the null block aside


def test_more_than_the_trained_context_is_refused_without_rope_scaling(plain):
    with pytest.raises(
        ConfigError, match=f"trained for {TRAINED} tokens.*no RoPE scaling.*at most {TRAINED}"
    ):
        Engine.load(str(plain), config=EngineConfig(context_length=TRAINED * 2, **CONFIG))


def test_yarn_scaling_allows_its_factor_and_no_more(yarn):
    with Engine.load(str(yarn), config=EngineConfig(context_length=TRAINED * 4, **CONFIG)) as e:
        assert e.context_length == TRAINED * 4
    with pytest.raises(ConfigError, match=r"yarn RoPE scaling x4 over 512 reaches 2048"):
        Engine.load(str(yarn), config=EngineConfig(context_length=TRAINED * 4 + 1, **CONFIG))


def test_what_each_kind_of_scaling_reaches():
    assert scaled_context(
        40960, {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}
    ) == (
        131072,
        "yarn RoPE scaling x4 over 32768",
    )
    assert scaled_context(4096, {"type": "linear", "factor": 2})[0] == 8192
    assert scaled_context(4096, None) == (4096, None)
    assert scaled_context(4096, {"rope_type": "default"}) == (4096, None)
    # Llama 3.1's llama3 scaling: max_position_embeddings is already the scaled 128K
    assert (
        scaled_context(
            131072, {"rope_type": "llama3", "factor": 8, "original_max_position_embeddings": 8192}
        )[0]
        == 131072
    )


def test_the_limit_is_read_from_a_gguf_header_and_a_config_before_loading():
    """`check_model_args` refuses before any weight is read: the trained context and the RoPE scaling
    as a GGUF's metadata (Qwen3's YaRN: 32K x 4 over 32K) or a config.json declares them."""
    from mlx_engine.context_length import check_context_length, declared_context, gguf_declared_context

    qwen3 = {
        "general.architecture": "qwen3",
        "qwen3.context_length": 40960,
        "qwen3.rope.scaling.type": "yarn",
        "qwen3.rope.scaling.factor": 4.0,
        "qwen3.rope.scaling.original_context_length": 32768,
    }
    trained, scaling = gguf_declared_context(qwen3)
    assert check_context_length(131072, trained, scaling, "qwen3") == 131072
    with pytest.raises(ConfigError, match="use at most 131072"):
        check_context_length(131073, trained, scaling, "qwen3")
    plain = {"general.architecture": "llama", "llama.context_length": 8192, "llama.rope.scaling.type": "none"}
    assert gguf_declared_context(plain) == (8192, None)
    config = {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert check_context_length(8192, *declared_context(config), "m") == 8192
    assert declared_context({"text_config": {"max_position_embeddings": 1024}}) == (1024, None)

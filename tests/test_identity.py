"""One model identity and numerics profile: the disk tier never reads KV of other weights or numerics."""

from __future__ import annotations

import asyncio
import shutil

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.loading.identity import model_fingerprint
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationRequest, SamplingParams
from tests.tiny_models import make_tiny_model_dir


def _generate(engine: Engine, prompt: list[int]) -> int:
    """Run one greedy request; return how many prompt tokens came from the prefix cache."""

    async def run() -> int:
        req = GenerationRequest(prompt=prompt, max_tokens=2, sampling=SamplingParams(temperature=0))
        last = None
        async for ev in engine.generate(req):
            last = ev
        assert last is not None and last.usage is not None
        return last.usage.cached_tokens

    return asyncio.run(run())


def test_fingerprint_follows_the_weights_not_the_path(tmp_path):
    a = make_tiny_model_dir(tmp_path / "a", "llama", seed=0)
    b = shutil.copytree(a, tmp_path / "b")
    c = make_tiny_model_dir(tmp_path / "c", "llama", seed=1)
    assert model_fingerprint(a) == model_fingerprint(b)  # same bytes elsewhere: same model
    assert model_fingerprint(a) != model_fingerprint(c)  # other weights: another model
    assert model_fingerprint(a).startswith("xxh3-128:")


def test_disk_tier_is_keyed_by_identity_and_numerics(tmp_path):
    model = make_tiny_model_dir(tmp_path / "m", "llama", seed=0)
    prompt = list(range(3, 53))  # 50 tokens: 3 full blocks of 16
    cache = tmp_path / "kv"
    cfg = {"cache_gb": 0.01, "disk_cache_dir": str(cache), "disk_cache_gb": 0.1}

    first = Engine(load_model(str(model)), EngineConfig(**cfg))
    _generate(first, prompt)
    first.shutdown()  # flushes the cached blocks to the disk tier

    same = Engine(load_model(str(model)), EngineConfig(**cfg))
    try:
        assert _generate(same, prompt) == 48  # a restart on the same model and numerics reads them back
    finally:
        same.shutdown()

    quantized = Engine(load_model(str(model)), EngineConfig(kv_bits=8, **cfg))
    try:
        assert _generate(quantized, prompt) == 0  # another KV format: the float blocks are not read
    finally:
        quantized.shutdown()

    make_tiny_model_dir(model, "llama", seed=1)  # new weights at the same path
    retrained = Engine(load_model(str(model)), EngineConfig(**cfg))
    try:
        assert _generate(retrained, prompt) == 0  # other weights: never the old model's KV
    finally:
        retrained.shutdown()


def test_system_fingerprint_names_model_and_numerics(tiny_dirs):
    from app.server.app import create_app

    model = load_model(str(tiny_dirs("llama")))
    plain, quantized = (
        Engine(model, EngineConfig(cache_gb=0.01)),
        Engine(model, EngineConfig(cache_gb=0.01, kv_bits=8)),
    )
    try:
        fp = [create_app(e).state.duet.fingerprint for e in (plain, quantized)]
        assert fp[0].startswith("fp_") and fp[0] != fp[1]
        assert create_app(plain).state.duet.fingerprint == fp[0]  # stable
    finally:
        plain.shutdown()
        quantized.shutdown()

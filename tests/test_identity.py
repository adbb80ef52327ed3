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


def test_a_fingerprint_is_remembered_across_starts_until_the_file_changes(tmp_path, monkeypatch):
    """The next process reads a model's fingerprint from the 0600 store instead of hashing the
    file again; a file rewritten in place, with its size and modification time put back, is hashed
    again (its change time moved) and gets its new fingerprint."""
    import os
    import stat

    import xxhash

    from mlx_engine.loading import identity

    monkeypatch.setenv("DUET_DATA_DIR", str(tmp_path / "data"))
    f = tmp_path / "m.gguf"
    f.write_bytes(os.urandom(1 << 20))
    first = model_fingerprint(f)
    store = tmp_path / "data" / "fingerprints.json"
    assert stat.S_IMODE(store.stat().st_mode) == 0o600

    hashed: list[int] = []
    real = xxhash.xxh3_128

    def counting(*args):
        hashed.append(1)
        return real(*args)

    monkeypatch.setattr(identity.xxhash, "xxh3_128", counting)
    identity._memo.clear()  # as a new process starts
    assert model_fingerprint(f) == first and not hashed  # from the store: the file is not read

    before = f.stat()
    data = bytearray(f.read_bytes())
    data[100] ^= 1
    f.write_bytes(bytes(data))
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))  # its old modification time put back
    while f.stat().st_ctime_ns == before.st_ctime_ns:  # a coarse clock: wait for the change time to move
        os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert f.stat().st_size == before.st_size and f.stat().st_mtime_ns == before.st_mtime_ns
    identity._memo.clear()
    second = model_fingerprint(f)
    assert hashed and second != first
    identity._memo.clear()
    assert model_fingerprint(f) == second  # the store now holds the new one


def test_a_broken_or_foreign_store_is_not_trusted(tmp_path, monkeypatch):
    """A store that is not JSON, or holds something else, is ignored (the file hashed) and replaced."""
    from mlx_engine.loading import identity

    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    monkeypatch.setenv("DUET_DATA_DIR", str(data))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(4096))
    expected = model_fingerprint(f)
    for junk in ("not json", '["a list"]', '{"%s": "sha1:deadbeef"}'):
        key = next(iter(identity._read_store(data / "fingerprints.json")))
        (data / "fingerprints.json").write_text(junk.replace("%s", key))
        identity._memo.clear()
        assert model_fingerprint(f) == expected

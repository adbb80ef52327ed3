"""``Engine.stats()`` is one consistent snapshot, taken on the worker between two steps: a request is
never out of view while it is in the engine, an engine with nothing running holds no KV block, and
once a caller has seen its request end, the very next snapshot shows it gone and its blocks free."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationRequest, SamplingParams
from tests.test_engine_tiny import prompts, run_all
from tests.tiny_models import TINY_TOKENS

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    cfg = EngineConfig(cache_gb=0.01, block_size=16, max_batch_tokens=64, prefill_chunk=32, max_running=3)
    e = Engine(load_model(str(tiny_dirs("llama"))), cfg)
    yield e
    e.shutdown()


def test_every_snapshot_is_consistent_while_requests_come_and_go(engine):
    snaps = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            snaps.append(engine.stats())

    poller = threading.Thread(target=poll, daemon=True)
    for rnd in range(3):
        reqs = [
            GenerationRequest(
                prompt=p, max_tokens=6, sampling=GREEDY, ignore_eos=True, request_id=f"s{rnd}-{i}"
            )
            for i, p in enumerate(prompts(TINY_TOKENS, [5, 40, 70, 20, 33], seed=rnd))
        ]
        if rnd == 0:
            poller.start()
        asyncio.run(run_all(engine, reqs))
        after = engine.stats()  # the first snapshot after every request ended: no waiting on it
        assert (after.running, after.waiting, after.loading, after.kv_blocks_used) == (0, 0, 0, 0)
    stop.set()
    poller.join(30)
    assert len(snaps) > 10
    steps = [s.steps for s in snaps]
    assert steps == sorted(steps)  # snapshots never go back in time
    for s in snaps:
        assert 0 <= s.running <= 3 and s.waiting >= 0
        assert s.kv_blocks_used <= s.kv_blocks_total
        if s.running == 0 and s.loading == 0:
            assert s.kv_blocks_used == 0, s  # nothing running holds no block
    assert any(s.running > 0 for s in snaps)

"""The prefix cache through the real Engine (tiny fp32 random model).

A prompt sent again gives the same tokens and log-probabilities as the first time, also when it
exactly fills whole KV blocks; every response reports its own cached tokens; a block is reused
only once its KV is fully computed while its sequence is still prefilling; and a finished
sequence's part-full last block serves the next turn to the token.
"""

from __future__ import annotations

import asyncio
import os
import threading

import mlx.core as mx
import pytest

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.kv_cache.prefix_disk import PrefixDiskTier
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationEvent, GenerationRequest, SamplingParams
from tests.test_engine_tiny import assert_no_leaks, prompts, reference_greedy

BS = 16


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return load_model(str(tiny_dirs("llama")))


@pytest.fixture
def engine(loaded):
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, block_size=BS))
    yield engine
    engine.shutdown()


def greedy(prompt: list[int], n: int, logprobs: bool = False) -> GenerationRequest:
    return GenerationRequest(
        prompt=prompt,
        max_tokens=n,
        ignore_eos=True,
        sampling=SamplingParams(temperature=0.0, logprobs=logprobs, top_logprobs=3 if logprobs else 0),
    )


async def collect(engine: Engine, r: GenerationRequest) -> list[GenerationEvent]:
    return [ev async for ev in engine.generate(r)]


def run(engine: Engine, r: GenerationRequest) -> list[GenerationEvent]:
    evs = asyncio.run(collect(engine, r))
    assert evs[-1].finish_reason == "length", evs[-1].error
    return evs


def tokens(evs: list[GenerationEvent]) -> list[int]:
    return [t for ev in evs for t in ev.token_ids]


@pytest.mark.parametrize("num_blocks", [1, 2])
def test_a_block_aligned_prompt_sent_twice_gives_the_same_tokens_and_logprobs(loaded, engine, num_blocks):
    (p,) = prompts(loaded.tokenizer.vocab_size, [num_blocks * BS], seed=30 + num_blocks)
    first = run(engine, greedy(p, 8, logprobs=True))
    second = run(engine, greedy(p, 8, logprobs=True))
    assert tokens(first) == tokens(second) == reference_greedy(loaded.model, p, 8)
    lp1 = [lp for ev in first for lp in ev.logprobs]
    lp2 = [lp for ev in second for lp in ev.logprobs]
    assert len(lp1) == len(lp2) == 8
    for a, b in zip(lp1, lp2, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top]
        assert [v for _, _, v in a.top] == pytest.approx([v for _, _, v in b.top], abs=1e-4)
    # all but the last token came from the cache (the last block's first 15 through a copy); the
    # last token is recomputed for the logits
    assert first[-1].usage.cached_tokens == 0
    assert second[-1].usage.cached_tokens == num_blocks * BS - 1
    assert_no_leaks(engine)


def test_usage_reports_each_requests_own_cached_tokens(loaded, engine):
    vocab = loaded.tokenizer.vocab_size
    base, tail1, tail2, other = prompts(vocab, [40, 5, 7, 20], seed=40)
    cached = [run(engine, greedy(p, 3))[-1].usage.cached_tokens for p in (base, base[:32] + tail1)]
    assert cached == [0, 32]
    # later hits: each reports what it reused, not a running total
    assert run(engine, greedy(base[:16] + tail2, 3))[-1].usage.cached_tokens == 16
    assert run(engine, greedy(other, 3))[-1].usage.cached_tokens == 0
    assert run(engine, greedy(base[:32] + tail2, 3))[-1].usage.cached_tokens == 32
    assert engine.stats().prefix_hit_tokens == 32 + 16 + 32
    assert_no_leaks(engine)


def test_a_conversation_reuses_only_the_tokens_whose_kv_was_computed(loaded, engine):
    (p, more) = prompts(loaded.tokenizer.vocab_size, [20, 5], seed=50)
    # 20 + 12 = 32 tokens end exactly on a block boundary: the last one was sampled, never computed,
    # so the second block is cached part-full (a tail) with the 15 before it
    out = tokens(run(engine, greedy(p, 12)))
    follow = p + out + more
    evs = run(engine, greedy(follow, 6))
    assert evs[-1].usage.cached_tokens == 31
    assert tokens(evs) == reference_greedy(loaded.model, follow, 6)
    assert_no_leaks(engine)


def test_next_turns_reuse_the_last_turns_part_full_block_and_leave_it_intact(loaded, engine):
    """A conversation's turns end mid-block. Each next turn reuses the previous turn's prompt and
    reply to the token, copying the part-full block before writing on; two next turns that diverge
    inside that block (a regenerated reply, an edited message) run at once and both get what they
    would alone, and the cached block still serves a third."""
    vocab = loaded.tokenizer.vocab_size
    p, more_a, more_b = prompts(vocab, [21, 6, 4], seed=51)
    out = tokens(run(engine, greedy(p, 5)))  # 25 tokens computed: one full block and 9 of the next
    turn_a, turn_b = p + out + more_a, p + out[:3] + more_b

    async def both():
        return await asyncio.gather(collect(engine, greedy(turn_a, 6)), collect(engine, greedy(turn_b, 6)))

    evs_a, evs_b = asyncio.run(both())
    assert [evs_a[-1].usage.cached_tokens, evs_b[-1].usage.cached_tokens] == [25, 24]
    assert tokens(evs_a) == reference_greedy(loaded.model, turn_a, 6)
    assert tokens(evs_b) == reference_greedy(loaded.model, turn_b, 6)
    again = run(engine, greedy(turn_a, 6))
    assert again[-1].usage.cached_tokens == len(turn_a) - 1  # all but the last, which gives logits
    assert tokens(again) == tokens(evs_a)
    assert_no_leaks(engine)


def test_a_block_still_being_prefilled_is_not_shared(loaded):
    """B arrives while A has written only part of a block that B's prompt shares: B must compute
    that block itself (and get what it would alone); once A has filled it, later requests reuse it.

    The worker is held after A's first prefill chunk until B is queued, so the interleaving is
    the same on every run."""
    vocab = loaded.tokenizer.vocab_size
    pa, tail_b, tail_c = prompts(vocab, [40, 8, 8], seed=60)
    pb, pc = pa[:BS] + tail_b, pa[:BS] + tail_c
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, block_size=BS, prefill_chunk=4, max_batch_tokens=8))
    first_chunk_done, b_queued = threading.Event(), threading.Event()
    forward = engine.runner.forward

    def held_forward(rows):
        out = forward(rows)
        if not first_chunk_done.is_set():
            first_chunk_done.set()
            b_queued.wait(timeout=60)
        return out

    engine.runner.forward = held_forward

    async def a_then_b():
        task_a = asyncio.create_task(collect(engine, greedy(pa, 6)))
        assert await asyncio.to_thread(first_chunk_done.wait, 60)
        task_b = asyncio.create_task(collect(engine, greedy(pb, 6)))
        async with asyncio.timeout(60):
            while engine.stats().waiting == 0:  # B is in the engine's queue
                await asyncio.sleep(0)
        b_queued.set()
        return await task_a, await task_b

    try:
        evs_a, evs_b = asyncio.run(a_then_b())
        assert tokens(evs_a) == reference_greedy(loaded.model, pa, 6)
        assert evs_b[-1].usage.cached_tokens == 0  # A's first block was 4/16 computed when B came
        assert tokens(evs_b) == reference_greedy(loaded.model, pb, 6)
        evs_c = run(engine, greedy(pc, 6))
        assert evs_c[-1].usage.cached_tokens == BS  # complete now: reused
        assert tokens(evs_c) == reference_greedy(loaded.model, pc, 6)
        assert_no_leaks(engine)
    finally:
        b_queued.set()
        engine.shutdown()


def test_after_a_restart_the_disk_tier_serves_every_block_before_the_last_token(loaded, tmp_path):
    """A 33-token prompt whose first 32 tokens are two whole blocks on disk: after a restart both
    load (including the one ending right before the last token), so only the last token is
    computed, and the output is the model's."""
    base, (last,) = prompts(loaded.tokenizer.vocab_size, [2 * BS, 1], seed=70)
    cfg = EngineConfig(cache_gb=0.01, block_size=BS, disk_cache_dir=str(tmp_path / "kv"), disk_cache_gb=0.1)
    first = Engine(loaded, cfg)
    try:
        run(first, greedy(base, 1))  # 32 tokens computed: two whole blocks
    finally:
        first.shutdown()  # flushes them to disk
    assert len(list((tmp_path / "kv").rglob("*.safetensors"))) == 2
    prompt = base + [last]
    second = Engine(loaded, cfg)  # a restart: nothing cached in memory
    try:
        assert second.disk is not None
        evs = run(second, greedy(prompt, 6))
        assert evs[-1].usage.cached_tokens == 2 * BS  # 1 token computed, not 17
        assert second.disk.loaded == 2
        assert tokens(evs) == reference_greedy(loaded.model, prompt, 6)
        assert_no_leaks(second)
    finally:
        second.shutdown()


def test_the_disk_tier_over_its_cap_deletes_the_least_recently_used_files(tmp_path):
    """Saving past ``max_bytes`` deletes the files used longest ago: a load counts as a use, so a
    block read back after a restart outlives one nobody asked for since."""
    disk = PrefixDiskTier(tmp_path / "kv", {"m": 1}, 2**30, block_size=4, num_layers=1)
    blocks = KVPool(1, 4, 4, 1, 8, mx.float32).read_block(1)
    a, b, c = [list(range(i, i + 4)) for i in (1, 11, 21)]
    disk.save(a, blocks)
    disk.save(b, blocks)
    size = disk._path(a).stat().st_size
    os.utime(disk._path(a), (1_000, 1_000))  # both used long ago, b more recently than a
    os.utime(disk._path(b), (2_000, 2_000))
    assert disk.load(a) is not None  # a is used now: b is the least recently used
    disk.max_bytes = 2 * size + size // 2  # room for two files
    disk.save(c, blocks)
    assert [disk.has(t) for t in (a, b, c)] == [True, False, True]

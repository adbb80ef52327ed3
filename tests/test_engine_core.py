"""The engine core (``mlx_engine/engine/core.py``) stepped directly, on the test's own thread: no
worker, no mailbox. It must give what the threaded ``Engine`` gives, and free what it held."""

from __future__ import annotations

import asyncio
import queue

import pytest

from mlx_engine.engine import Engine, EngineConfig, EngineCore
from mlx_engine.engine.messages import MailboxSink
from mlx_engine.engine.outputs import RequestState
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationEvent, GenerationRequest, SamplingParams
from mlx_engine.tokenization.reply_memory import ReplyMemory
from tests.test_engine_tiny import kv_token_bytes, prompts, reference_greedy, run_all
from tests.tiny_models import TINY_TOKENS

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return load_model(str(tiny_dirs("llama")))


def config(**kw) -> EngineConfig:
    return EngineConfig(
        **{"cache_gb": 0.01, "block_size": 16, "max_batch_tokens": 64, "prefill_chunk": 32, **kw}
    )


def core_for(loaded, cfg: EngineConfig) -> EngineCore:
    return EngineCore(
        loaded,
        cfg,
        context_length=loaded.context_length,
        draft=None,
        replies=ReplyMemory(),
        sink=MailboxSink(queue.SimpleQueue()),
        identity=lambda: "test",
    )


def test_the_core_steps_without_a_thread_and_matches_the_engine(loaded):
    ps = prompts(TINY_TOKENS, [5, 40, 70], seed=3)
    reqs = [
        GenerationRequest(prompt=p, max_tokens=10, sampling=GREEDY, ignore_eos=True, request_id=f"r{i}")
        for i, p in enumerate(ps)
    ]

    async def drive() -> tuple[dict[int, list[int]], int]:
        core = core_for(loaded, config())
        events: asyncio.Queue = asyncio.Queue()
        for i, r in enumerate(reqs):
            core.add(RequestState.new(core.inputs.prepare(r), core.tokenizer, events, key=i))
        steps = 0
        while core.step():
            steps += 1
        # the events of every step wait in the core's outbox, tagged with their key
        got: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
        finished = set()
        for _, (key, ev) in core.outbox[asyncio.get_running_loop()]:
            assert isinstance(ev, GenerationEvent)
            got[key] += ev.token_ids
            if ev.finished:
                assert ev.finish_reason == "length" and ev.usage.completion_tokens == 10
                finished.add(key)
        assert finished == set(range(len(reqs)))
        core.allocator.check_invariants()
        assert core.allocator.num_used == 0 and not core.requests
        return got, steps

    got, steps = asyncio.run(drive())
    assert steps >= 10  # a token per step once prefilled: the core ran every step itself
    expected = [reference_greedy(loaded.model, p, 10) for p in ps]
    assert [got[i] for i in range(len(ps))] == expected
    with Engine(loaded, config()) as engine:
        assert asyncio.run(run_all(engine, reqs)) == expected


def test_a_padded_output_layer_never_emits_an_id_that_is_no_token(loaded):
    """The tiny model scores a few rows past its tokenizer's ids (as many real models' output
    layers do): with every real token but one banned, the padding rows must not win."""
    assert (
        loaded.model.lm_head.weight.shape[0] > loaded.tokenizer.vocab_size
        if "lm_head" in loaded.model
        else True
    )
    only = 123
    bias = {i: -100.0 for i in range(loaded.tokenizer.vocab_size) if i != only}
    (p,) = prompts(TINY_TOKENS, [20], seed=5)
    sampling = SamplingParams(temperature=0.0, logit_bias=bias)
    with Engine(loaded, config()) as engine:
        (ids,) = asyncio.run(
            run_all(engine, [GenerationRequest(prompt=p, max_tokens=8, sampling=sampling, ignore_eos=True)])
        )
    assert ids == [only] * 8


def test_a_reply_without_max_tokens_ends_where_the_kv_cache_is_full(loaded):
    """The context (2048 tokens) is larger than the KV cache (4 usable blocks, 64 tokens): a reply
    with no max_tokens ends for length when prompt and reply fill the cache, it never waits for
    room that cannot come."""
    per_block = 16 * kv_token_bytes(loaded)
    core = core_for(loaded, config(cache_gb=5 * per_block / 2**30))
    kv_tokens = (core.allocator.num_blocks - 1) * 16
    assert kv_tokens == 64 < loaded.context_length
    (p,) = prompts(TINY_TOKENS, [5], seed=6)
    r = GenerationRequest(prompt=p, max_tokens=None, sampling=GREEDY, ignore_eos=True, request_id="r")

    async def drive() -> list[GenerationEvent]:
        events: asyncio.Queue = asyncio.Queue()
        core.add(RequestState.new(core.inputs.prepare(r), core.tokenizer, events))
        steps = 0
        while core.step():
            steps += 1
            assert steps <= 2 * kv_tokens, "the core keeps stepping a reply that cannot end"
        return [ev for _, ev in core.outbox[asyncio.get_running_loop()]]

    events = asyncio.run(drive())
    assert events and events[-1].finish_reason == "length", "the reply never ended"
    usage = events[-1].usage
    assert usage.prompt_tokens + usage.completion_tokens == kv_tokens
    assert [t for ev in events for t in ev.token_ids] == reference_greedy(loaded.model, p, kv_tokens - 5)
    core.allocator.check_invariants()
    assert core.allocator.num_used == 0 and not core.requests

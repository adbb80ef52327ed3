"""Prefix-cache isolation by cache salt (issue 11: ``cached_tokens`` tells one client whether
another's prompt began with a guessed prefix).

Requests with different salts never share cached blocks, requests with the same salt do, and the
unsalted cache is one more salt of its own. Salted blocks never reach the disk tier, whose files
are keyed by tokens alone. Checked on the prefix index, the allocator, the scheduler and the
engine (a tiny model).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.errors import RequestError
from mlx_engine.kv_cache.block_allocator import BlockAllocator
from mlx_engine.kv_cache.prefix_index import PrefixIndex
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationRequest, SamplingParams
from mlx_engine.scheduler import Scheduler, SchedulerConfig, Sequence

BS = 4
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_index_matches_only_under_the_same_salt():
    idx = PrefixIndex(BS)
    idx.insert(TOKENS, [10, 11], salt="alice")
    assert idx.match(TOKENS, salt="alice") == [10, 11]
    assert idx.match(TOKENS, salt="bob") == []
    assert idx.match(TOKENS) == []  # the unsalted cache does not see it either
    idx.insert(TOKENS, [20, 21])
    assert idx.match(TOKENS) == [20, 21]
    assert idx.match(TOKENS, salt="alice") == [10, 11]
    assert idx.salt_of(10) == "alice" and idx.salt_of(20) is None
    assert sorted(idx.blocks()) == [10, 11, 20, 21]
    assert sorted(idx.blocks(salted=False)) == [20, 21]
    idx.check_invariants()
    # evicting a salt's last block forgets the salt
    idx.remove_block(10)
    assert idx.match(TOKENS, salt="alice") == [] and len(idx) == 2
    assert idx._salted == {}
    idx.check_invariants()


def test_allocator_shares_blocks_only_within_a_salt_and_never_spills_salted_ones():
    spilled = []
    a = BlockAllocator(num_blocks=5, block_size=BS)
    a.on_evict = lambda b, toks: spilled.append(toks)
    mine = a.allocate(2)
    a.register(TOKENS, mine, 2, "alice")
    a.free(mine)  # cached, reference count 0
    assert a.match_prefix(TOKENS, 8, "bob") == []
    assert a.match_prefix(TOKENS, 8) == []
    hit = a.match_prefix(TOKENS, 8, "alice")
    assert hit == mine
    a.free(hit)
    theirs = a.allocate(2)
    a.register(TOKENS, theirs, 2)
    a.free(theirs)
    # allocating everything evicts both: only the unsalted blocks go to the disk tier
    a.allocate(4)
    assert sorted(spilled) == [TOKENS[:4], TOKENS[:8]]
    a.check_invariants()


def run_prompt(sched: Scheduler, rid: str, salt: str | None) -> Sequence:
    seq = Sequence(rid, list(range(1, 11)), 10, 12, cache_salt=salt)
    sched.add(seq)
    while seq.status != "finished":
        step = sched.schedule()
        assert set(step.tokens) <= {rid}
        for r in sched.advance(step):
            assert r == rid
            seq.tokens.append(99)
            if len(seq.tokens) >= seq.max_total:
                sched.finish(seq)
    return seq


def test_scheduler_counts_cached_tokens_within_a_salt_only():
    sched = Scheduler(BlockAllocator(64, BS), SchedulerConfig(max_queue=10))
    assert run_prompt(sched, "a1", "alice").num_cached == 0
    assert run_prompt(sched, "b1", "bob").num_cached == 0  # same prompt, another salt: no hit
    assert run_prompt(sched, "u1", None).num_cached == 0
    # same salt: all but the last prompt token cached (2 full blocks and 1 token of a part-full one)
    assert run_prompt(sched, "a2", "alice").num_cached == 9
    assert run_prompt(sched, "u2", None).num_cached == 9
    sched.alloc.check_invariants()


# --- the engine ------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [(7 * i) % 200 + 3 for i in range(40)]  # 2 full blocks of 16, and a tail


async def usage(engine: Engine, **kw):
    req = GenerationRequest(prompt=list(PROMPT), max_tokens=2, sampling=GREEDY, ignore_eos=True, **kw)
    async for ev in engine.generate(req):
        if ev.finished:
            return ev.usage


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    e = Engine.load(str(tiny_dirs("llama")), config=EngineConfig(cache_gb=0.01))
    yield e
    e.shutdown()


def test_engine_cached_tokens_differ_by_salt(engine):
    assert asyncio.run(usage(engine, cache_salt="alice")).cached_tokens == 0
    assert asyncio.run(usage(engine, cache_salt="bob")).cached_tokens == 0
    assert asyncio.run(usage(engine)).cached_tokens == 0
    assert asyncio.run(usage(engine, cache_salt="alice")).cached_tokens == 39  # all but the last
    assert asyncio.run(usage(engine, cache_salt="bob")).cached_tokens == 39
    assert asyncio.run(usage(engine)).cached_tokens == 39
    engine.allocator.check_invariants()
    assert engine.allocator.num_used == 0


def test_n_choices_fork_only_within_a_salt(engine):
    async def run():
        lead = GenerationRequest(
            prompt=[9] * 40, max_tokens=3, sampling=GREEDY, ignore_eos=True, cache_salt="x", request_id="lead"
        )
        other = GenerationRequest(
            prompt=[9] * 40, max_tokens=3, sampling=GREEDY, ignore_eos=True, cache_salt="y", fork_of="lead"
        )

        async def last(req):
            async for ev in engine.generate(req):
                if ev.finished:
                    return ev.usage

        return await asyncio.gather(last(lead), last(other))

    lead_usage, other_usage = asyncio.run(run())
    assert other_usage.cached_tokens == 0  # it did not share the other salt's prompt KV
    assert engine.allocator.num_used == 0


def test_bad_salt_is_a_clear_error(engine):
    with pytest.raises(RequestError, match="cache_salt must be a string"):
        engine.prepare_prompt(GenerationRequest(prompt=[1, 2], cache_salt=["a"]))
    with pytest.raises(RequestError, match="group must be a string"):
        engine.prepare_prompt(GenerationRequest(prompt=[1, 2], group=3))


def test_salted_prefixes_never_reach_the_disk_tier(tiny_dirs, tmp_path):
    loaded = load_model(str(tiny_dirs("llama")))
    cfg = EngineConfig(cache_gb=0.01, disk_cache_dir=str(tmp_path / "kv"), disk_cache_gb=0.1)
    first = Engine(loaded, cfg)
    try:
        asyncio.run(usage(first, cache_salt="alice"))
    finally:
        first.shutdown()  # flushes the cached blocks to disk: none of them is unsalted
    assert list((tmp_path / "kv").rglob("*.safetensors")) == []
    second = Engine(loaded, cfg)
    try:
        assert asyncio.run(usage(second)).cached_tokens == 0
        asyncio.run(usage(second, cache_salt="alice"))
    finally:
        second.shutdown()
    assert len(list((tmp_path / "kv").rglob("*.safetensors"))) == 2  # the unsalted prompt's blocks


def test_server_body_cache_salt(engine):
    from app.server.app import create_app

    text = "The quick brown fox jumps over the lazy dog. " * 4  # a few full blocks

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=create_app(engine))
        cached = []
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            for salt in ["s1", "s2", "s1", None]:
                body = {"model": engine.model_name, "prompt": text, "max_tokens": 1}
                if salt is not None:
                    body["cache_salt"] = salt
                r = await client.post("/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                u = r.json()["usage"]
                cached.append(u["prompt_tokens_details"]["cached_tokens"])
                prompt_tokens.append(u["prompt_tokens"])
            bad = {"model": engine.model_name, "prompt": text, "max_tokens": 1, "cache_salt": 5}
            r = await client.post("/v1/completions", json=bad, timeout=60)
            assert r.status_code == 400 and "cache_salt" in r.text
        return cached

    prompt_tokens: list[int] = []
    first, other, again, unsalted = asyncio.run(run())
    assert first == 0 and other == 0 and unsalted == 0
    assert again == prompt_tokens[2] - 1  # all but the last token, which is computed for its logits

"""The engine computes the same thing however a request is scheduled (tiny fp32 random models).

Alone, in a batch of 8 with mixed prompt lengths, with any prefill chunk size, after a prefix
cache hit, after preemption and recompute: greedy outputs are token-identical to mlx-lm's own
generation loop on the same weights. And no KV block leaks afterwards.
"""

from __future__ import annotations

import asyncio
import random

import mlx.core as mx
import pytest

from mlx_engine.backend import backend_name
from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.kv_cache.kv_pool import KVPool
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationRequest, RequestError, SamplingParams
from tests.tiny_models import ARCHS, TINY_TOKENS

GREEDY = SamplingParams(temperature=0.0)


def pool_dtype(loaded) -> mx.Dtype:
    """What an engine's KV pool stores for ``loaded`` by default (float16 for a float32 model on the CPU)."""
    return KVPool.store_dtype("auto", loaded.dtype, None, backend_name())


def kv_token_bytes(loaded, dtype: mx.Dtype | None = None) -> int:
    """One token's K and V in every layer of a pool storing ``dtype`` (the default pool's when None)."""
    per_layer = KVPool.bytes_per_token_per_layer(
        loaded.n_kv_heads, loaded.head_dim, dtype or pool_dtype(loaded), None
    )
    return loaded.num_layers * per_layer


def reference_greedy(model, prompt: list[int], n: int, vocab: int | None = TINY_TOKENS) -> list[int]:
    """mlx-lm's generate_step with its own KV cache: the independent reference, choosing among the
    tokenizer's ``vocab`` ids (the tiny models' output layers have a few rows past it; None: all)."""
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(
        mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x[..., :vocab], axis=-1)
    ):
        out.append(int(tok))
    return out


async def run_all(engine: Engine, reqs: list[GenerationRequest]) -> list[list[int]]:
    async def one(r):
        ids = []
        async for ev in engine.generate(r):
            ids.extend(ev.token_ids)
        return ids

    return await asyncio.gather(*(one(r) for r in reqs))


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def req(p, n=12, **kw):
    return GenerationRequest(prompt=p, max_tokens=n, sampling=GREEDY, ignore_eos=True, **kw)


def assert_no_leaks(engine: Engine):
    engine.allocator.check_invariants()
    assert engine.allocator.num_used == 0, "KV blocks still held after every request ended"
    # the draft model's per-sequence state goes with its sequence (its KV lives in their blocks)
    assert not getattr(getattr(engine, "_proposer", None), "states", {}), "draft state of ended requests"


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request, tiny_dirs):
    path = tiny_dirs(request.param)
    loaded = load_model(str(path))
    return request.param, loaded


@pytest.mark.parametrize("kv_dtype", ["auto", "float32"])
def test_alone_and_batched_match_mlx_lm(arch_setup, kv_dtype):
    """Greedy tokens of mlx-lm's loop (float32 KV), from the default pool (float16 KV under these
    float32 models on the CPU) and from a float32 one."""
    arch, loaded = arch_setup
    ps = prompts(loaded.tokenizer.vocab_size, [1, 5, 17, 33, 2, 64, 16, 40])
    expected = [reference_greedy(loaded.model, p, 12) for p in ps]
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, block_size=16, kv_dtype=kv_dtype))
    want = pool_dtype(loaded) if kv_dtype == "auto" else mx.float32
    assert engine.pool.dtype == want and engine.pool.k[0].dtype == want
    assert engine.stats().kv_block_bytes == 16 * kv_token_bytes(loaded, want)
    try:
        alone = [asyncio.run(run_all(engine, [req(p)]))[0] for p in ps[:3]]
        assert alone == expected[:3], arch
        batched = asyncio.run(run_all(engine, [req(p) for p in ps]))
        assert batched == expected, arch
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_the_reference_attention_path_matches_mlx_lm_on_a_sliding_window_model(tiny_dirs):
    """The reference route (gather + masked SDPA: what runs where no kernel takes a pass, e.g.
    quantized KV on the CPU, prefill on Metal) applies each layer's sliding window: batched rows
    of different lengths, longer than the window, give mlx-lm's tokens."""
    from mlx_engine.kv_cache.paged_attention import AttentionRoute

    loaded = load_model(str(tiny_dirs("gemma3_text")))
    ps = prompts(loaded.tokenizer.vocab_size, [3, 21, 37, 50], seed=9)
    expected = [reference_greedy(loaded.model, p, 10) for p in ps]
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, block_size=16, kv_dtype="float32"))
    engine.runner.attention = AttentionRoute.reference()
    try:
        assert asyncio.run(run_all(engine, [req(p, 10) for p in ps])) == expected
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 64])
def test_chunked_prefill_any_chunk_size(tiny_dirs, chunk):
    loaded = load_model(str(tiny_dirs("llama")))
    ps = prompts(loaded.tokenizer.vocab_size, [45, 9, 30], seed=chunk)
    expected = [reference_greedy(loaded.model, p, 8) for p in ps]
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, prefill_chunk=chunk, max_batch_tokens=max(chunk, 8)))
    try:
        assert asyncio.run(run_all(engine, [req(p, 8) for p in ps])) == expected
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_prefix_cache_hit_gives_same_tokens(tiny_dirs):
    loaded = load_model(str(tiny_dirs("qwen3")))
    (base,) = prompts(loaded.tokenizer.vocab_size, [70], seed=3)
    turn2 = base + prompts(loaded.tokenizer.vocab_size, [11], seed=4)[0]
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, block_size=16))
    try:
        asyncio.run(run_all(engine, [req(base)]))
        before = engine.stats().prefix_hit_tokens
        got = asyncio.run(run_all(engine, [req(turn2)]))[0]
        # the whole 70-token prefix: 4 full blocks and the first 6 tokens of the part-full fifth
        assert engine.stats().prefix_hit_tokens - before == 70
        assert got == reference_greedy(loaded.model, turn2, 12)
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_preemption_and_recompute_keep_outputs(tiny_dirs):
    loaded = load_model(str(tiny_dirs("llama")))
    ps = prompts(loaded.tokenizer.vocab_size, [30, 28, 26, 31, 29, 27], seed=7)
    expected = [reference_greedy(loaded.model, p, 40) for p in ps]
    # room for ~2.5 sequences at full length: the scheduler must preempt and recompute
    per_block = 16 * kv_token_bytes(loaded)
    engine = Engine(loaded, EngineConfig(cache_gb=12 * per_block / 2**30, block_size=16, prefix_cache=False))
    try:
        got = asyncio.run(run_all(engine, [req(p, 40) for p in ps]))
        assert engine.stats().preemptions > 0
        assert got == expected
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_kv_quantization_runs_batched_with_prefix_cache(tiny_dirs):
    loaded = load_model(str(tiny_dirs("llama")))
    ps = prompts(loaded.tokenizer.vocab_size, [40, 40, 12], seed=9)
    ps[1] = ps[0][:32] + ps[1][32:]  # shared prefix
    for bits in (8, 4):
        engine = Engine(loaded, EngineConfig(cache_gb=0.01, kv_bits=bits))
        try:
            out = asyncio.run(run_all(engine, [req(p, 10) for p in ps]))
            assert all(len(o) == 10 for o in out)
            assert engine.stats().kv_bits == bits
            assert_no_leaks(engine)
        finally:
            engine.shutdown()


def test_cancel_and_break_free_blocks(tiny_dirs):
    loaded = load_model(str(tiny_dirs("llama")))
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, prefix_cache=False))
    (p,) = prompts(loaded.tokenizer.vocab_size, [20])

    async def stop_early():
        n = 0
        async for ev in engine.generate(req(p, 1000)):
            n += len(ev.token_ids)
            if n >= 3:
                break
        # breaking out cancels the request; the engine drops it on its worker thread: wait for that
        # (the request gone and its blocks released), with a deadline only for a hang or a leak
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while True:
            s = engine.stats()
            if s.running == 0 and s.waiting == 0 and s.kv_blocks_used == 0:
                break
            assert loop.time() < deadline, f"the cancelled request still holds KV blocks: {s}"
            await asyncio.sleep(0.01)

    try:
        asyncio.run(stop_early())
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_bad_requests_are_clear_errors(tiny_dirs):
    loaded = load_model(str(tiny_dirs("llama")))
    engine = Engine(loaded, EngineConfig(cache_gb=0.01))

    async def first(r):
        async for _ in engine.generate(r):
            break

    try:
        for r, param in [
            (GenerationRequest(prompt="", max_tokens=5), "prompt"),
            (GenerationRequest(prompt="hi", max_tokens=0), "max_tokens"),
            (GenerationRequest(prompt="hi", sampling=SamplingParams(top_p=0)), "top_p"),
            (GenerationRequest(prompt=[1] * 5000), "prompt"),
            (GenerationRequest(messages=[]), "messages"),
        ]:
            with pytest.raises(RequestError) as e:
                asyncio.run(first(r))
            assert e.value.param == param
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_prefix_from_disk_tier_after_restart(tiny_dirs, tmp_path):
    loaded = load_model(str(tiny_dirs("qwen2")))
    (base,) = prompts(loaded.tokenizer.vocab_size, [50], seed=11)
    follow = base + prompts(loaded.tokenizer.vocab_size, [9], seed=12)[0]
    cfg = EngineConfig(cache_gb=0.01, disk_cache_dir=str(tmp_path / "kv"), disk_cache_gb=0.1)
    first = Engine(loaded, cfg)
    asyncio.run(run_all(first, [req(base)]))
    first.shutdown()  # flushes cached blocks to disk
    assert len(list((tmp_path / "kv").rglob("*.safetensors"))) == 3  # 50 tokens -> 3 full blocks
    second = Engine(loaded, cfg)  # a restart: empty memory cache
    try:
        got = asyncio.run(run_all(second, [req(follow)]))[0]
        assert second.stats().prefix_hit_tokens == 48
        assert second.disk.loaded == 3
        assert got == reference_greedy(loaded.model, follow, 12)
        assert_no_leaks(second)
    finally:
        second.shutdown()


def test_evicted_blocks_spill_to_disk_and_come_back(tiny_dirs, tmp_path):
    loaded = load_model(str(tiny_dirs("llama")))
    ps = prompts(loaded.tokenizer.vocab_size, [64, 64, 64], seed=13)
    per_block = 16 * kv_token_bytes(loaded)
    # 9 usable blocks: the third prompt evicts the first one's cached blocks
    cfg = EngineConfig(cache_gb=10 * per_block / 2**30, disk_cache_dir=str(tmp_path / "kv"))
    engine = Engine(loaded, cfg)
    try:
        for p in ps:
            asyncio.run(run_all(engine, [req(p, 4)]))
        assert engine.disk.saved >= 4
        again = ps[0] + [5, 6, 7]
        got = asyncio.run(run_all(engine, [req(again, 6)]))[0]
        assert engine.disk.loaded >= 4
        assert got == reference_greedy(loaded.model, again, 6)
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_decode_through_metal_kernel_source_in_emulator(tiny_dirs, kv_bits):
    """The engine's Metal decode path (the kernel's exact MSL, run by the CPU emulator) over the
    real paged pool gives the same greedy tokens as the MLX reference path."""
    from mlx_engine.kv_cache import paged_attention

    loaded = load_model(str(tiny_dirs("llama")))
    ps = prompts(loaded.tokenizer.vocab_size, [20, 37], seed=21)

    def run(kernel: bool):
        engine = Engine(loaded, EngineConfig(cache_gb=0.01, kv_bits=kv_bits))
        route = paged_attention.AttentionRoute
        engine.runner.attention = route.metal_kernels("emulator") if kernel else route.reference()
        try:
            return asyncio.run(run_all(engine, [req(p, 5) for p in ps]))
        finally:
            engine.shutdown()

    assert run(True) == run(False)


def test_seeded_sampling_is_independent_of_the_batch(tiny_dirs):
    loaded = load_model(str(tiny_dirs("llama")))
    ps = prompts(loaded.tokenizer.vocab_size, [12, 30, 7, 19], seed=5)
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    mine = GenerationRequest(prompt=ps[0], max_tokens=16, sampling=sp, ignore_eos=True)
    engine = Engine(loaded, EngineConfig(cache_gb=0.01))
    try:
        alone = asyncio.run(run_all(engine, [mine]))[0]
        others = [
            GenerationRequest(
                prompt=p,
                max_tokens=16,
                ignore_eos=True,
                sampling=SamplingParams(temperature=0.7, top_k=5, seed=i),
            )
            for i, p in enumerate(ps[1:])
        ]
        mine2 = GenerationRequest(prompt=ps[0], max_tokens=16, sampling=sp, ignore_eos=True)
        batched = asyncio.run(run_all(engine, [*others, mine2]))[-1]
        assert batched == alone
        other_seed = GenerationRequest(
            prompt=ps[0],
            max_tokens=16,
            ignore_eos=True,
            sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=99),
        )
        assert asyncio.run(run_all(engine, [other_seed]))[0] != alone
    finally:
        engine.shutdown()


def test_stop_strings_logprobs_and_usage_through_the_engine(tiny_dirs):
    loaded = load_model(str(tiny_dirs("llama")))
    tok = loaded.tokenizer
    (p,) = prompts(tok.vocab_size, [10], seed=8)
    engine = Engine(loaded, EngineConfig(cache_gb=0.01))

    async def collect(r):
        evs = []
        async for ev in engine.generate(r):
            evs.append(ev)
        return evs

    try:
        free = asyncio.run(collect(req(p, 20)))
        text = "".join(e.text for e in free)
        assert text == tok.decode([t for e in free for t in e.token_ids])
        stop = text[5:8]
        assert stop
        r2 = GenerationRequest(
            prompt=p,
            max_tokens=20,
            sampling=SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
            stop=[stop],
            ignore_eos=True,
        )
        evs = asyncio.run(collect(r2))
        out = "".join(e.text for e in evs)
        assert out == text[: text.index(stop)] and stop not in out
        assert evs[-1].finish_reason == "stop" and evs[-1].stop_reason == stop
        lps = [lp for e in evs for lp in e.logprobs]
        assert lps and all(len(lp.top) == 3 and lp.top[0][0] == lp.token_id for lp in lps)  # greedy = best
        u = evs[-1].usage
        assert u.prompt_tokens == 10 and u.completion_tokens == len(lps) and u.ttft_s > 0
    finally:
        engine.shutdown()


def test_a_reply_cut_by_max_tokens_keeps_the_text_held_back_for_a_stop_string(tiny_dirs):
    """The stop matcher holds back text that may begin a stop string; when max_tokens ends the
    reply first, that text is still the reply's (its last event carries it)."""
    loaded = load_model(str(tiny_dirs("llama")))
    (p,) = prompts(loaded.tokenizer.vocab_size, [10], seed=8)
    engine = Engine(loaded, EngineConfig(cache_gb=0.01))

    async def collect(r):
        return [ev async for ev in engine.generate(r)]

    try:
        free = asyncio.run(collect(req(p, 12)))
        text = "".join(ev.text for ev in free)
        assert len(text) >= 2 and free[-1].finish_reason == "length"
        stop = text[-2:] + "\u2603 never generated"  # the reply ends in the first two characters of it
        evs = asyncio.run(collect(req(p, 12, stop=[stop])))
        assert "".join(ev.text for ev in evs) == text
        assert evs[-1].finish_reason == "length" and evs[-1].text  # the held-back text comes last
    finally:
        engine.shutdown()


def test_stop_token_ids_end_the_reply_at_the_first_one_sampled(tiny_dirs):
    """``GenerationRequest.stop_token_ids`` stop a reply like EOS does (even with ``ignore_eos``):
    the stop token is the last id, its text is not emitted."""
    loaded = load_model(str(tiny_dirs("llama")))
    (p,) = prompts(loaded.tokenizer.vocab_size, [10], seed=9)
    free = reference_greedy(loaded.model, p, 12)
    stop_id = free[4]
    want = free[: free.index(stop_id) + 1]
    engine = Engine(loaded, EngineConfig(cache_gb=0.01))

    async def collect(r):
        return [ev async for ev in engine.generate(r)]

    try:
        evs = asyncio.run(collect(req(p, 12, stop_token_ids=[stop_id])))
        assert [t for ev in evs for t in ev.token_ids] == want
        assert evs[-1].finish_reason == "stop" and evs[-1].stop_reason == stop_id
        assert "".join(ev.text for ev in evs) == loaded.tokenizer.decode(want[:-1])
        assert evs[-1].usage.completion_tokens == len(want)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("prompt_len", [37, 33, 48])  # last block partly filled / one token in it / full
def test_n_choices_share_the_prompt_copy_on_write(tiny_dirs, prompt_len):
    """n > 1: the other choices fork the first one's prompt KV (the partly filled last block
    included) and diverge by sampling; each still computes exactly what it would alone."""
    loaded = load_model(str(tiny_dirs("qwen2")))
    (p,) = prompts(loaded.tokenizer.vocab_size, [prompt_len], seed=11)

    def choice(i, **kw):
        return GenerationRequest(
            prompt=p,
            max_tokens=20,
            ignore_eos=True,
            request_id=f"c{i}-{kw}",
            sampling=SamplingParams(temperature=1.0, seed=100 + i),
            **kw,
        )

    # plain decoding: the count below is of tokens through the model (proposals would add to it)
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, block_size=16, prefix_cache=False, speculative="off"))
    try:
        alone = [asyncio.run(run_all(engine, [choice(i)]))[0] for i in range(4)]
        assert len({tuple(a) for a in alone}) == 4, "the seeds should give different samples"
        processed = []
        forward = engine.runner.forward
        engine.runner.forward = lambda rows: (
            processed.append(sum(len(r.tokens) for r in rows)),
            forward(rows),
        )[1]
        lead = choice(0, fork_of=None)
        forked = asyncio.run(
            run_all(engine, [lead] + [choice(i, fork_of=lead.request_id) for i in range(1, 4)])
        )
        assert forked == alone
        # the prompt is computed once; each other choice recomputes only its last token
        assert sum(processed) == prompt_len + 3 + 4 * 19
        assert engine.stats().prefix_hit_tokens == 3 * (prompt_len - 1)
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_fork_of_a_finished_or_different_request_runs_normally(tiny_dirs):
    loaded = load_model(str(tiny_dirs("llama")))
    a, b = prompts(loaded.tokenizer.vocab_size, [21, 21], seed=12)
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, block_size=16))
    try:
        first = req(a, n=1)
        asyncio.run(run_all(engine, [first]))
        late = req(a, fork_of=first.request_id)  # the leader is gone: the prefix cache serves it
        other = req(b, fork_of=late.request_id)  # a different prompt is never forked
        got = asyncio.run(run_all(engine, [late, other]))
        assert got == [reference_greedy(loaded.model, a, 12), reference_greedy(loaded.model, b, 12)]
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_cache_budget_as_a_fraction_of_memory(tiny_dirs):
    from mlx_engine.backend import total_memory_bytes

    loaded = load_model(str(tiny_dirs("llama")))
    budget = 0.001 * total_memory_bytes()
    engine = Engine(loaded, EngineConfig(cache_fraction=0.001))
    try:
        s = engine.stats()
        block_bytes = engine.pool.max_nbytes / (s.kv_blocks_total + 1)
        assert budget - block_bytes < engine.pool.max_nbytes <= budget  # what it may grow to
        assert engine.pool.nbytes < engine.pool.max_nbytes  # taken as used, not at start
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="cache_fraction"):
        Engine(loaded, EngineConfig(cache_fraction=1.5))
    with pytest.raises(ValueError, match="not both"):
        Engine(loaded, EngineConfig(cache_gb=1, cache_fraction=0.1))

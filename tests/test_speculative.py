"""Speculative decoding (prompt lookup) inside the batched scheduler step.

Proposals are verified in the same forward pass as every other row; kept ones commit, the rest
roll back their KV. What a user cares about: the output is the same tokens as plain decoding
(greedy, and sampled with a seed), whatever the batch, chunking, prefix hits or preemption; no KV
block leaks; stop strings and max_tokens hold; and the proposals were really used.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.errors import ConfigError
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationRequest, SamplingParams
from mlx_engine.speculative import NgramProposer, SpeculationPolicy
from tests.test_engine_tiny import assert_no_leaks
from tests.test_reply_reuse import printable_only

# --- the proposer and the policy -------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_occurrence():
    p = NgramProposer(max_ngram=3)
    assert p.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 3) == [8, 9, 1]
    # the longest n-gram wins; among equal ones the most recent
    assert p.propose([1, 2, 3, 4, 0, 2, 3, 7, 2, 3], 2) == [7, 2]
    assert p.propose([1, 2, 3, 4, 0, 9, 3, 5, 9, 3], 1) == [5]
    assert p.propose([1, 2, 3], 4) == []  # nothing repeats
    assert p.propose([4, 4], 0) == []


def test_policy_proposes_for_a_lone_stream_and_not_in_a_busy_batch():
    pol = SpeculationPolicy(cost_ratio=0.5, measure=False)  # a pass's cost is mostly its tokens
    assert pol.choose(100, 90, decoding_rows=1) >= 3  # high acceptance, one stream
    assert pol.choose(100, 90, decoding_rows=16) == 0
    assert pol.choose(100, 5, decoding_rows=1) == 0  # proposals rarely kept: stop proposing
    assert pol.choose(0, 0, decoding_rows=64) == 0


def test_a_new_sequence_starts_from_the_engines_recent_acceptance():
    """On text the proposer cannot predict, every request used to start from a fixed 60% prior and
    pay for proposals until its own eight verdicts said otherwise; now a new sequence starts from what
    the engine's recent sequences kept, and text that predicts well starts out proposing more. A
    sequence still gets one probe of its own, so the engine's record cannot starve it."""
    fresh = SpeculationPolicy(cost_ratio=0.1, measure=False)
    assert fresh.choose(0, 0, decoding_rows=1) >= 1  # the prior: worth a try
    rejected = SpeculationPolicy(cost_ratio=0.1, measure=False)
    for _ in range(10):
        rejected.verdict(2, 0)
    assert rejected.prior() == 0.0
    assert rejected.choose(0, 0, decoding_rows=1) == 1  # one probe of its own: its first proposal
    assert rejected.choose(1, 0, decoding_rows=1) == 0  # rejected: no more on the engine's record
    assert rejected.choose(1, 1, decoding_rows=1) >= 1  # kept: this text predicts, go on
    assert rejected.choose(0, 0, decoding_rows=64) == 0  # no probe where the fixed prior would not try
    assert rejected.choose(100, 95, decoding_rows=1) >= 3  # a sequence's own record still decides
    kept = SpeculationPolicy(cost_ratio=0.1, measure=False)
    for _ in range(10):
        kept.verdict(4, 4)
    assert kept.choose(0, 0, decoding_rows=1) > fresh.choose(0, 0, decoding_rows=1)
    rejected.verdict(0, 0)  # nothing proposed: no verdict
    assert rejected.prior() == 0.0


def test_policy_counts_the_pass_that_rows_without_proposals_keep():
    """Measured on the bundled model (4 streams, quantized CPU weights): a pass costs ~21 ms and a
    token ~6 ms (r ~ 0.29). Rows without proposals keep a pass of their own, so at 4 streams a
    60%-kept proposal costs more than it brings (it did: 0.76x of off); alone it pays."""
    pol = SpeculationPolicy(cost_ratio=0.29, measure=False)
    assert pol.choose(100, 60, decoding_rows=4) == 0
    assert pol.choose(100, 60, decoding_rows=1) >= 1
    assert pol.choose(100, 95, decoding_rows=4) >= 1  # nearly every proposal kept: still worth it


def test_policy_measures_what_a_token_costs_in_a_pass():
    pol = SpeculationPolicy()
    for passes, tokens in [(1, 1), (1, 4), (2, 8), (1, 16), (1, 2), (3, 20)]:
        pol.observe(passes, tokens, 0.010 * passes + 0.002 * tokens)  # a = 10 ms, c = 2 ms
    assert pol.cost_ratio == pytest.approx(0.2, rel=1e-6)
    cheap = SpeculationPolicy()
    for passes, tokens in [(1, 1), (1, 4), (2, 8), (1, 16)]:
        cheap.observe(passes, tokens, 0.010 * passes + 0.00001 * tokens)  # per-op overhead only
    assert cheap.choose(100, 60, decoding_rows=8) > pol.choose(100, 60, decoding_rows=8) == 0


def test_a_lone_row_uses_its_measured_step_costs_where_they_are_not_a_line():
    """On the CPU one or two rows of x take the integer matmul kernel and three or more the float one:
    a lone row's step with 1, 2, 3, 4, 6 tokens measured 1.00, 1.23, 1.57, 1.82, 2.44x (bundled model,
    one kernel thread). The line fitted through them prices 3 tokens too low; with up to 70% of
    the proposals kept only k = 1 pays. Until a size is measured, the line stands in (and trying it
    measures it); a batch keeps the line."""
    pol = SpeculationPolicy()
    for tokens, rel in [(1, 1.00), (2, 1.23), (3, 1.57), (4, 1.82), (6, 2.44)] * 3:
        pol.observe(1, tokens, 0.020 * rel, rows=1)
    assert pol.choose(100, 52, decoding_rows=1) == pol.choose(100, 70, decoding_rows=1) == 1
    assert pol.choose(100, 95, decoding_rows=1) >= 3  # nearly every proposal kept: longer pays
    line = SpeculationPolicy(cost_ratio=pol.cost_ratio, measure=False)
    assert line.choose(100, 70, decoding_rows=1) == 2  # what the line alone would have chosen
    assert pol.choose(100, 60, decoding_rows=4) == line.choose(100, 60, decoding_rows=4)
    fresh = SpeculationPolicy()
    fresh.observe(1, 1, 0.020, rows=1)  # nothing with proposals measured yet: the prior line
    assert fresh.choose(100, 52, decoding_rows=1) == SpeculationPolicy().choose(100, 52, decoding_rows=1)


def test_the_cost_model_learns_from_decoding_steps_only(tiny_dirs, monkeypatch):
    """Prompt tokens cost less each than decoding ones (on the CPU many rows of x take another matmul
    path); fitted together they made a proposed token look free in a busy batch. Every step the
    policy is shown holds decoding rows (one token each, or one plus its proposals), none a prompt."""
    loaded = load_model(str(tiny_dirs("llama")))
    # 64-token prompts in chunks of 32: a step with prompt tokens holds at least 32 tokens, one of
    # three decoding rows at most 3 * (1 + max_k) = 18
    engine = Engine(loaded, EngineConfig(cache_gb=0.01, prefill_chunk=32, max_batch_tokens=64))
    seen: list[tuple[int, int]] = []
    real = engine.speculation.observe
    monkeypatch.setattr(
        engine.speculation, "observe", lambda p, t, s, **kw: (seen.append((p, t)), real(p, t, s, **kw))[1]
    )
    ps = [(p * 16)[:64] for p in repetitive_prompts(loaded.tokenizer.vocab_size, 3, seed=4)]
    try:
        outs = asyncio.run(run_all(engine, greedy_reqs(ps, n=24)()))
    finally:
        engine.shutdown()
    assert all(len(ids) == 24 for ids, _ in outs)
    assert seen, "no step reached the cost model"
    assert all(tokens <= 3 * (1 + engine.speculation.max_k) for _, tokens in seen), seen


def test_an_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(speculative="eagle").validate(memory_bytes=8 << 30)


# --- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3_text"])
def loaded(request, tiny_dirs):
    return load_model(str(tiny_dirs(request.param)))


def repetitive_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (what editing or quoting a document looks like)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 12))]
        out.append(
            [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 9))] + phrase * rng.randrange(2, 5)
        )
    return out


async def run_all(engine: Engine, reqs: list[GenerationRequest], logprobs: list | None = None):
    """(ids, last event) per request; ``logprobs``, when given, is filled with each request's
    (token id, logprob) pairs, in request order.

    Every request is queued before the engine's worker takes any (it is held until then), so they
    are admitted together on every run. Which requests share a step would otherwise depend on
    timing, and a tiny random model's greedy choice between two nearly equal logits can flip with
    the shape of the batch (gemma3's 8-prompt case did, in off and on alike, under load)."""
    if logprobs is not None:
        logprobs[:] = [[] for _ in reqs]
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(60)

    held = asyncio.get_running_loop().run_in_executor(None, engine.run_on_worker, hold, 120)
    assert await asyncio.to_thread(started.wait, 60)

    async def one(i, r):
        ids, last = [], None
        async for ev in engine.generate(r):
            ids += ev.token_ids
            if logprobs is not None:
                logprobs[i] += [(lp.token_id, lp.logprob) for lp in ev.logprobs]
            last = ev
        return ids, last

    tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(reqs)]
    try:
        async with asyncio.timeout(60):
            while engine.stats().waiting < len(reqs):
                await asyncio.sleep(0.001)
    finally:
        release.set()
        await held
    return await asyncio.gather(*tasks)


def generate(
    loaded, reqs_of, speculative: str, logprobs: list | None = None, **cfg
) -> tuple[list[list[int]], list]:
    engine = Engine(loaded, EngineConfig(cache_gb=cfg.pop("cache_gb", 0.01), speculative=speculative, **cfg))
    # propose whenever the text allows, whatever this machine's timings: these tests are about
    # what verification does with proposals (the policy has its own tests)
    engine.speculation.measure, engine.speculation.cost_ratio = False, 0.0
    try:
        outs = asyncio.run(run_all(engine, reqs_of(), logprobs))
        assert_no_leaks(engine)
        return [ids for ids, _ in outs], [last for _, last in outs]
    finally:
        engine.shutdown()


N = 80  # long enough for a random model's greedy output to start repeating itself


def greedy_reqs(ps, n=N, sampling=None, **kw):
    return lambda: [
        GenerationRequest(
            prompt=p,
            max_tokens=n,
            ignore_eos=True,
            sampling=sampling or SamplingParams(temperature=0.0),
            **kw,
        )
        for p in ps
    ]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_output_is_identical_and_proposals_are_kept(loaded, batch):
    ps = repetitive_prompts(loaded.tokenizer.vocab_size, batch, seed=batch)
    off, _ = generate(loaded, greedy_reqs(ps), "off")
    on, lasts = generate(loaded, greedy_reqs(ps), "ngram")
    assert on == off
    spec = [ev.usage.speculative for ev in lasts]
    assert all(s is not None for s in spec)
    assert sum(s["proposed"] for s in spec) > 0, spec  # the test really went through verification
    assert all(0 <= s["accepted"] <= s["proposed"] for s in spec)
    assert all(len(ids) == N for ids in on)  # max_tokens holds with several tokens per step


def test_a_stream_that_repeats_itself_keeps_its_proposals(tiny_dirs):
    loaded = load_model(str(tiny_dirs("qwen3")))  # its greedy output falls into a loop early
    ps = repetitive_prompts(loaded.tokenizer.vocab_size, 2, seed=1)
    off, _ = generate(loaded, greedy_reqs(ps), "off")
    on, lasts = generate(loaded, greedy_reqs(ps), "ngram")
    assert on == off
    for ev in lasts:
        s = ev.usage.speculative
        assert s["accepted"] >= 0.8 * s["proposed"] > 0, s
        # fewer forward passes than tokens: several tokens were emitted per step
        assert s["accepted"] >= N // 4


def test_greedy_identical_with_chunked_prefill_prefix_hits_and_preemption(loaded):
    ps = repetitive_prompts(loaded.tokenizer.vocab_size, 6, seed=7)
    ps += [ps[0] + ps[1], ps[0]]  # prefix hits on blocks the first requests computed
    # a pool so small that sequences are preempted and recomputed; small prefill chunks
    cfg = dict(cache_gb=0.0008, block_size=8, prefill_chunk=16, max_batch_tokens=32)
    off, _ = generate(loaded, greedy_reqs(ps), "off", **cfg)
    on, lasts = generate(loaded, greedy_reqs(ps), "ngram", **cfg)
    assert on == off
    assert sum(ev.usage.speculative["proposed"] for ev in lasts) > 0


def test_seeded_sampling_gives_the_same_tokens_as_plain_decoding(loaded):
    """One random draw per emitted token, from the same distribution: a seed gives the same
    sample with proposals as without (so the output distribution is the target's)."""
    ps = repetitive_prompts(loaded.tokenizer.vocab_size, 4, seed=3)

    def reqs():
        return [
            GenerationRequest(
                prompt=p,
                max_tokens=N,
                ignore_eos=True,
                sampling=SamplingParams(temperature=0.7, top_p=0.95, seed=1000 + i, repetition_penalty=1.1),
            )
            for i, p in enumerate(ps)
        ]

    off, _ = generate(loaded, reqs, "off")
    on, lasts = generate(loaded, reqs, "ngram")
    assert on == off
    assert sum(ev.usage.speculative["proposed"] for ev in lasts) > 0


def test_a_batch_of_penalised_greedy_and_seeded_rows_matches_plain_decoding(loaded):
    """Greedy rows are verified in one batched sampler call, each position seeing the output as
    it would be with the proposals before it kept (penalties); seeded rows in the same steps are
    verified position by position. Tokens equal plain decoding's, log-probabilities too (to rounding)."""
    ps = repetitive_prompts(loaded.tokenizer.vocab_size, 6, seed=11)
    greedy = SamplingParams(
        temperature=0.0, repetition_penalty=1.05, frequency_penalty=0.2, logprobs=True, top_logprobs=2
    )

    def reqs():
        return [
            GenerationRequest(
                prompt=p,
                max_tokens=N,
                ignore_eos=True,
                sampling=greedy if i % 2 == 0 else SamplingParams(temperature=0.8, seed=70 + i),
            )
            for i, p in enumerate(ps)
        ]

    off_lps: list = []
    on_lps: list = []
    off, _ = generate(loaded, reqs, "off", logprobs=off_lps)
    on, on_last = generate(loaded, reqs, "ngram", logprobs=on_lps)
    assert on == off
    assert all(off_lps[::2]) and [[t for t, _ in r] for r in on_lps] == [[t for t, _ in r] for r in off_lps]
    # a position verified in a multi-token pass has the logits of a one-token pass up to rounding
    assert (
        max(
            abs(a - b)
            for r, q in zip(on_lps, off_lps, strict=True)
            for (_, a), (_, b) in zip(r, q, strict=True)
        )
        < 1e-3
    )
    assert sum(ev.usage.speculative["proposed"] for ev in on_last[::2]) > 0  # greedy rows were verified
    assert sum(ev.usage.speculative["proposed"] for ev in on_last[1::2]) > 0  # and seeded ones


def test_stop_strings_and_logprobs_hold(loaded):
    tok = loaded.tokenizer
    (p,) = repetitive_prompts(tok.vocab_size, 1, seed=5)
    bias = printable_only(tok)  # text a stop string can be taken from
    off_ids, _ = generate(
        loaded, greedy_reqs([p], sampling=SamplingParams(temperature=0.0, logit_bias=bias)), "off"
    )
    text = tok.decode(off_ids[0])
    # a stop string from the second half made of whole printable characters
    stop = next(
        (
            s
            for i in range(len(text) // 2, len(text) - 3)
            if (s := text[i : i + 3]).isprintable() and "\ufffd" not in s
        ),
        None,
    )
    assert stop is not None, text

    def reqs():
        return [
            GenerationRequest(
                prompt=p,
                max_tokens=N,
                ignore_eos=True,
                stop=[stop],
                sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2, logit_bias=bias),
            )
        ]

    engines = {}
    for mode in ("off", "ngram"):
        engine = Engine(loaded, EngineConfig(cache_gb=0.01, speculative=mode))
        engine.speculation.measure, engine.speculation.cost_ratio = False, 0.0
        try:

            async def go(engine=engine):
                evs = [ev async for ev in engine.generate(reqs()[0])]
                return evs

            evs = asyncio.run(go())
            assert_no_leaks(engine)
        finally:
            engine.shutdown()
        engines[mode] = (
            "".join(ev.text for ev in evs),
            [t for ev in evs for t in ev.token_ids],
            [round(lp.logprob, 3) for ev in evs for lp in ev.logprobs],
            evs[-1].finish_reason,
        )
    assert engines["ngram"] == engines["off"]
    assert engines["ngram"][3] == "stop"

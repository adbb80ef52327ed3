"""Speculative decoding with a draft model (``speculative="draft"``, mlx_engine/draft_model.py).

Tiny random-weight pairs that share a tokenizer: a draft with the target's own weights (nearly
every proposal kept) and one with other random weights (few kept). Whatever the draft proposes,
the output must be plain decoding's: greedy token-identical and seeded sampling the same tokens,
across batch sizes, chunked prefill, prefix hits, preemption and ``n > 1`` forks; the draft's KV
lives in the sequences' own blocks, so nothing may leak (``assert_no_leaks`` also checks that no
draft state outlives its request).
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from mlx_engine.engine import Engine, EngineConfig
from mlx_engine.errors import ConfigError
from mlx_engine.loading.loader import load_model
from mlx_engine.request import GenerationRequest, SamplingParams
from mlx_engine.speculative.draft_model import DraftModelProposer, output_rows
from tests.test_engine_tiny import assert_no_leaks
from tests.test_speculative import N, generate, greedy_reqs, repetitive_prompts, run_all
from tests.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def pair(request, tiny_dirs, tmp_path_factory):
    """(target, same-weights draft, other-weights draft) of one architecture."""
    path = tiny_dirs(request.param)
    other = make_tiny_model_dir(tmp_path_factory.mktemp("draft") / request.param, request.param, seed=7)
    return load_model(str(path)), load_model(str(path)), load_model(str(other))


def totals(lasts) -> tuple[int, int]:
    spec = [ev.usage.speculative for ev in lasts]
    assert all(s is not None and 0 <= s["accepted"] <= s["proposed"] for s in spec), spec
    return sum(s["proposed"] for s in spec), sum(s["accepted"] for s in spec)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_identical_and_a_same_weights_draft_is_kept(pair, batch):
    target, same, _ = pair
    ps = repetitive_prompts(target.tokenizer.vocab_size, batch, seed=batch)
    off, _ = generate(target, greedy_reqs(ps), "off")
    on, lasts = generate(target, greedy_reqs(ps), "draft", draft_model=same)
    assert on == off
    proposed, accepted = totals(lasts)
    assert accepted >= 0.9 * proposed > 0, (proposed, accepted)
    assert all(len(ids) == N for ids in on)  # max_tokens holds with several tokens per step


def test_greedy_identical_with_a_draft_that_guesses_badly(pair):
    target, _, other = pair
    ps = repetitive_prompts(target.tokenizer.vocab_size, 3, seed=11)
    off, _ = generate(target, greedy_reqs(ps), "off")
    on, lasts = generate(target, greedy_reqs(ps), "draft", draft_model=other)
    assert on == off
    proposed, accepted = totals(lasts)
    assert 0 < proposed and accepted <= 0.5 * proposed, (proposed, accepted)


def test_greedy_identical_with_chunked_prefill_prefix_hits_and_preemption(pair):
    target, same, _ = pair
    ps = repetitive_prompts(target.tokenizer.vocab_size, 6, seed=7)
    ps += [ps[0] + ps[1], ps[0]]  # prefix hits on blocks the first requests computed
    # a pool so small that sequences are preempted and recomputed (the draft's context too, in
    # pieces of prefill_chunk); small prefill chunks
    cfg = dict(cache_gb=0.0008, block_size=8, prefill_chunk=16, max_batch_tokens=32)
    off, _ = generate(target, greedy_reqs(ps), "off", **cfg)
    on, lasts = generate(target, greedy_reqs(ps), "draft", draft_model=same, **cfg)
    assert on == off
    proposed, accepted = totals(lasts)
    assert accepted >= 0.9 * proposed > 0, (proposed, accepted)


def test_forked_choices_are_identical(pair):
    """``n > 1``: choices share the leader's prompt blocks (copy-on-write in both pools)."""
    target, same, _ = pair
    (p,) = repetitive_prompts(target.tokenizer.vocab_size, 1, seed=5)

    def reqs():
        lead = GenerationRequest(
            prompt=p, max_tokens=N, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=1)
        )
        return [lead] + [
            GenerationRequest(
                prompt=p,
                max_tokens=N,
                ignore_eos=True,
                sampling=SamplingParams(temperature=0.8, seed=2 + i),
                fork_of=lead.request_id,
            )
            for i in range(3)
        ]

    off, _ = generate(target, reqs, "off", block_size=8)
    on, lasts = generate(target, reqs, "draft", draft_model=same, block_size=8)
    assert on == off
    assert totals(lasts)[0] > 0


def test_seeded_sampling_gives_the_same_tokens(pair):
    target, same, _ = pair
    ps = repetitive_prompts(target.tokenizer.vocab_size, 4, seed=3)

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

    off, _ = generate(target, reqs, "off")
    on, lasts = generate(target, reqs, "draft", draft_model=same)
    assert on == off
    assert totals(lasts)[1] > 0


def test_the_draft_runs_batched_across_sequences(pair):
    """One draft pass per proposal position for the whole step, not one per sequence."""
    import asyncio

    target, same, _ = pair
    ps = repetitive_prompts(target.tokenizer.vocab_size, 8, seed=8)
    engine = Engine(target, EngineConfig(cache_gb=0.01, speculative="draft", draft_model=same))
    engine.speculation.measure, engine.speculation.cost_ratio = False, 0.0
    try:
        outs = asyncio.run(run_all(engine, greedy_reqs(ps)()))
        proposer = engine.core.proposer
        assert isinstance(proposer, DraftModelProposer)
        proposed = sum(last.usage.speculative["proposed"] for _, last in outs)
        max_k = engine.speculation.max_k
        # unbatched, the draft would need a pass per proposal (plus catch-ups) of every sequence
        assert 0 < proposer.passes < proposed / 3, (proposer.passes, proposed, max_k)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def smaller_draft(tmp_path_factory):
    """A draft of another shape with the same tokenizer: one layer, float16, qwen3."""
    import mlx.core as mx

    path = make_tiny_model_dir(tmp_path_factory.mktemp("small") / "qwen3-1l", "qwen3", seed=3)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    weights = mx.load(str(path / "model.safetensors"))
    weights = {k: v.astype(mx.float16) for k, v in weights.items() if ".layers.1." not in k}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return load_model(str(path))


def test_a_draft_of_another_shape_shares_the_blocks_and_the_budget(tiny_dirs, smaller_draft):
    import asyncio

    target = load_model(str(tiny_dirs("llama")))
    assert (smaller_draft.num_layers, smaller_draft.dtype) != (target.num_layers, target.dtype)
    ps = repetitive_prompts(target.tokenizer.vocab_size, 8, seed=2)
    off, _ = generate(target, greedy_reqs(ps), "off")
    gib = 0.01
    engine = Engine(target, EngineConfig(cache_gb=gib, speculative="draft", draft_model=smaller_draft))
    engine.speculation.measure, engine.speculation.cost_ratio = False, 0.0
    try:
        outs = asyncio.run(run_all(engine, greedy_reqs(ps)()))
        assert [ids for ids, _ in outs] == off
        assert totals([last for _, last in outs])[0] > 0
        pool, draft_pool = engine.pool, engine.draft_pool
        assert draft_pool is not None and draft_pool.num_blocks == pool.num_blocks
        assert draft_pool.num_layers == 1 and draft_pool.dtype == smaller_draft.dtype
        # the pools grew together (8 sequences outgrow the first 512 tokens), within one budget
        assert draft_pool.capacity == pool.capacity > engine.config.kv_first_blocks()
        assert pool.max_nbytes + draft_pool.max_nbytes <= gib * 2**30
        assert pool.max_nbytes + 2 * draft_pool.max_nbytes > gib * 2**30  # the budget is used
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_a_later_turn_reuses_the_drafts_kv_of_its_history(pair):
    """A second turn's prompt holds the first turn's prompt and reply: its prefix hit covers
    blocks whose draft KV the first turn computed, so the draft computes only the new tokens."""
    import asyncio

    target, same, _ = pair
    (p,) = repetitive_prompts(target.tokenizer.vocab_size, 1, seed=6)
    engine = Engine(target, EngineConfig(cache_gb=0.01, speculative="draft", draft_model=same))
    engine.speculation.measure, engine.speculation.cost_ratio = False, 0.0
    try:
        ((first, _),) = asyncio.run(run_all(engine, greedy_reqs([p])()))
        proposer = engine.core.proposer
        assert isinstance(proposer, DraftModelProposer)
        done = proposer.tokens_computed
        second = p + first + [5, 6, 7]
        ((_, last),) = asyncio.run(run_all(engine, greedy_reqs([second])()))
        assert last.usage.cached_tokens >= len(p) + len(first) - 16  # the target's prefix hit
        assert last.usage.speculative["accepted"] > 0
        # the draft computes what the hit left (under 2 blocks) and the second reply (its tokens are
        # nearly all kept proposals): without the reuse it would compute the whole prompt again
        assert proposer.tokens_computed - done < N + 2 * 16, proposer.tokens_computed - done
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def test_no_proposals_past_the_drafts_context(tiny_dirs, short_context_dir):
    target, draft = load_model(str(tiny_dirs("llama"))), load_model(str(short_context_dir))
    assert draft.context_length == 48
    (p,) = repetitive_prompts(target.tokenizer.vocab_size, 1, seed=4)
    off, _ = generate(target, greedy_reqs([p]), "off")
    on, lasts = generate(target, greedy_reqs([p]), "draft", draft_model=draft)
    assert on == off and len(on[0]) == N  # the target's context goes on
    proposed, _ = totals(lasts)
    assert 0 < proposed <= 48 - len(p)


# --- the proposer alone: its KV bookkeeping ---------------------------------------------------


def test_proposals_are_the_drafts_greedy_continuation_after_any_rollback(pair):
    """Whatever verification kept (all, some, none), after a preemption (new blocks), on a prefix
    hit and on blocks another sequence drafted other tokens into, the proposals are the draft's
    greedy continuation of the real context, as mlx-lm computes it, and its KV is what a fresh
    computation gives: kept proposals' and cached blocks' KV reused, the rest recomputed."""
    import random

    from mlx_engine.kv_cache.kv_pool import KVPool
    from mlx_engine.model_runner import ModelRunner, Row
    from mlx_engine.scheduler import Sequence
    from tests.test_engine_tiny import reference_greedy

    _, draft, _ = pair
    vocab = draft.tokenizer.vocab_size
    bs = 8
    pool = KVPool(draft.num_layers, 64, bs, draft.n_kv_heads, draft.head_dim, draft.dtype)
    proposer = DraftModelProposer(draft, pool, output_rows(draft.model), chunk=8)  # context in pieces
    rng = random.Random(0)
    free = list(range(1, 64))
    seqs = []
    for i in range(2):  # two sequences: proposals computed in one batch
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 30))]
        seqs.append(Sequence(f"s{i}", list(prompt), len(prompt), 10_000))
    for seq in seqs:
        seq.blocks = [free.pop(0) for _ in range(12)]
    for round_ in range(12):
        for seq in seqs:
            seq.num_unverified = rng.randrange(1, 6)
            seq.tokens += [0] * seq.num_unverified
        behind = proposer.fill(seqs)
        for seq in seqs:
            st = proposer.states[seq.request_id]
            if seq in behind:  # more than a piece behind: caught up by one, no proposals
                assert st.valid <= seq.num_verified - 1 and not st.proposed
                seq.tokens[seq.num_verified :] = [rng.randrange(3, vocab)]  # decoded plainly
                seq.num_unverified = 0
            else:
                real, drafts = seq.tokens[: seq.num_verified], seq.tokens[seq.num_verified :]
                assert drafts == reference_greedy(draft.model, real, len(drafts)), (round_, seq.request_id)
            # the draft's KV of what it claims (context, proposals but the last): as computed afresh
            ctx = seq.tokens[: st.valid] + st.proposed
            fresh = KVPool(draft.num_layers, 64, bs, draft.n_kv_heads, draft.head_dim, draft.dtype)
            ModelRunner(draft.model, fresh).forward([Row(ctx, 0, seq.blocks)])
            for layer in range(draft.num_layers):
                got = pool.read_tokens(layer, seq.blocks, 0, len(ctx))
                want = fresh.read_tokens(layer, seq.blocks, 0, len(ctx))
                for g, w in zip(got, want, strict=True):
                    assert mx.allclose(g, w, atol=1e-4).item(), (round_, seq.request_id, layer)
            if seq in behind:
                continue
            # verification: keep some, then a token other than the next proposal
            kept = rng.randrange(len(drafts) + 1)
            nxt = drafts[kept] if kept < len(drafts) else -1
            other = rng.choice([t for t in range(3, vocab) if t != nxt])
            seq.tokens[seq.num_verified :] = drafts[:kept] + [other]
            seq.num_unverified = 0
        if round_ == 4:  # preempted and re-admitted: other blocks, the draft's KV is not there
            seqs[0].preemptions += 1
            seqs[0].blocks = [free.pop(0) for _ in range(12)]
        if round_ == 7:
            # s1 finished; another sequence with the same first block takes its blocks and
            # drafts other tokens into part of the second
            old = seqs.pop(1)
            proposer.forget(old.request_id)
            assert old.num_verified > 2 * bs and proposer.marks.get(old.blocks[1]) is not None
            tokens = old.tokens[:bs] + [t % (vocab - 1) + 1 for t in old.tokens[bs : bs + 3]]
            other = Sequence("t", tokens, len(tokens), 10_000)
            other.blocks = old.blocks
            seqs.append(other)
        if round_ == 8:
            # a prefix hit on s0's full blocks: their draft KV is reused, not recomputed
            done = proposer.tokens_computed
            n = proposer.states["s0"].valid // bs * bs  # the blocks s0's draft has filled
            assert n >= 2 * bs
            hit = Sequence("hit", seqs[0].tokens[:n] + [5, 6, 7], n + 3, 10_000)
            hit.blocks = seqs[0].blocks[: n // bs] + [free.pop(0) for _ in range(4)]
            hit.num_unverified = 1
            hit.tokens.append(0)
            assert proposer.fill([hit]) == []
            assert proposer.tokens_computed - done == 3  # its own tokens only
            assert hit.tokens[-1] == reference_greedy(draft.model, hit.tokens[:-1], 1)[0]
            proposer.forget("hit")
            # the other sequence finished; s1's old tokens on its old blocks, which the other
            # sequence overwrote: recomputed
            proposer.forget(seqs.pop(1).request_id)
            stale = Sequence("stale", old.tokens[: old.num_verified], old.num_verified, 10_000)
            stale.blocks, stale.num_unverified = old.blocks, 2
            stale.tokens += [0, 0]
            proposer.fill([stale])
            ctx = stale.tokens[: proposer.states["stale"].valid]
            fresh = KVPool(draft.num_layers, 64, bs, draft.n_kv_heads, draft.head_dim, draft.dtype)
            ModelRunner(draft.model, fresh).forward([Row(ctx, 0, stale.blocks)])
            for layer in range(draft.num_layers):
                got = pool.read_tokens(layer, stale.blocks, 0, len(ctx))
                for g, w in zip(got, fresh.read_tokens(layer, stale.blocks, 0, len(ctx)), strict=True):
                    assert mx.allclose(g, w, atol=1e-4).item(), layer
            proposer.forget("stale")
    for seq in seqs:
        proposer.forget(seq.request_id)
    assert not proposer.states


def test_the_policy_counts_what_a_draft_pass_costs():
    from mlx_engine.speculative import SpeculationPolicy

    free, costly = SpeculationPolicy(), SpeculationPolicy()
    for pol in (free, costly):
        for passes, tokens in [(1, 1), (1, 4), (2, 8), (1, 16)]:
            pol.observe(passes, tokens, 0.010 * passes + 0.0001 * tokens)  # a = 10 ms
    costly.observe_draft(5, 5 * 0.008)  # a draft pass: 8 ms, most of a target pass
    assert costly.draft_cost == pytest.approx(0.8, rel=1e-6)
    assert free.choose(100, 80, decoding_rows=1) > costly.choose(100, 80, decoding_rows=1)
    assert costly.choose(100, 40, decoding_rows=1) == 0  # proposals often rejected: not worth a pass


# --- options -----------------------------------------------------------------------------------


def test_draft_mode_and_draft_model_go_together():
    with pytest.raises(ConfigError, match="draft_model") as e:
        EngineConfig(speculative="draft").validate(memory_bytes=8 << 30)
    assert e.value.option == "draft_model"
    with pytest.raises(ConfigError, match="only with"):
        EngineConfig(speculative="ngram", draft_model="x").validate(memory_bytes=8 << 30)
    EngineConfig(speculative="draft", draft_model="x").validate(memory_bytes=8 << 30)


def test_a_draft_with_another_tokenizer_is_refused(tiny_dirs, tmp_path):
    path = tiny_dirs("llama")
    target = load_model(str(path))
    other = tmp_path / "other-ids"
    shutil.copytree(path, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]  # same tokens, two of them with each other's ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ConfigError, match="tokenizer") as e:
        Engine(target, EngineConfig(cache_gb=0.01, speculative="draft", draft_model=str(other)))
    assert e.value.option == "draft_model"

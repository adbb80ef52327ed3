import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mlx_engine.request import SamplingParams
from mlx_engine.sampling import sampler as sampler_module
from mlx_engine.sampling.sampler import CANDIDATES, SampleResult, SamplerRow, make_rng, sample

V = 49152  # SmolLM2's vocabulary


def sampling(**kw) -> SamplingParams:
    """Sampling parameters with top_k, top_p, min_p and the penalties off unless a test sets them:
    these tests are about the sampler, not the front ends' defaults (``mlx_engine/defaults.py``)."""
    return SamplingParams(**{"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, **kw})


@pytest.fixture(autouse=True, params=["numpy", "mlx"])
def array_lib(request, monkeypatch):
    """Run every test with both array libraries: numpy is what MLX's CPU backend uses, MLX what
    Metal and CUDA use (forced here onto MLX's CPU backend)."""
    xp = np if request.param == "numpy" else mx
    monkeypatch.setattr(sampler_module, "_xp", lambda: xp)
    return xp


def rows_for(params: SamplingParams, n: int, seed0: int = 0, **kw) -> list[SamplerRow]:
    return [SamplerRow(params, make_rng(seed0 + i), **kw) for i in range(n)]


def draw_many(logits: np.ndarray, params: SamplingParams, n: int, seed0: int = 0, **kw) -> np.ndarray:
    """n independent draws from one logit vector: one batched call, one seeded row per draw."""
    batch = mx.array(np.tile(np.asarray(logits, dtype=np.float32), (n, 1)))
    return np.array([r.token_id for r in sample(batch, rows_for(params, n, seed0, **kw))])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def support(logits: np.ndarray, p: SamplingParams, slack: float = 0.0) -> set[int]:
    """Tokens the documented pipeline may draw (float64 reference); ``slack`` loosens the
    top_p / min_p thresholds so float32 rounding at a boundary is not counted as an error."""
    z = np.asarray(logits, dtype=np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")
    zs = z[order]
    keep = np.isfinite(zs)
    if p.top_k:
        keep &= zs >= zs[min(p.top_k, len(zs)) - 1]  # ties with the k-th are as good as it
    w = np.where(keep, np.exp(zs - zs[0]), 0.0)
    probs = w / w.sum()
    excl = np.cumsum(probs) - probs
    if p.top_p < 1:
        keep &= excl < p.top_p + slack
    if p.min_p > 0:
        keep &= zs >= zs[0] + math.log(max(p.min_p - slack, 1e-12))
    # which of several tied tokens is kept is arbitrary, and the sampler compares in float32:
    # logits that differ in float64 may be equal there (e.g. 0 and a subnormal, after temperature)
    z32 = (np.asarray(logits, dtype=np.float32) / np.float32(p.temperature))[order]
    keep |= z32 == z32[keep].min()
    return {int(t) for t in order[keep]}


# --- greedy ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_greedy_is_argmax(dtype):
    logits = mx.random.normal((5, V), key=mx.random.key(1)).astype(dtype)
    got = [r.token_id for r in sample(logits, rows_for(sampling(temperature=0), 5))]
    assert got == np.argmax(np.array(logits.astype(mx.float32)), axis=-1).tolist()
    assert all(isinstance(t, int) for t in got)


def test_greedy_ties_take_the_lowest_id():
    logits = np.zeros((2, 100), dtype=np.float32)
    logits[0, [7, 3, 50]] = 5.0
    logits[1, [99, 98]] = 1.0
    for extra in ({}, {"logprobs": True}):  # fast path and general path
        res = sample(mx.array(logits), rows_for(sampling(temperature=0, **extra), 2))
        assert [r.token_id for r in res] == [3, 98]


def test_greedy_on_the_adjusted_logits():
    logits = np.zeros((1, 10), dtype=np.float32)
    logits[0, 4] = 3.0
    p = sampling(temperature=0, logit_bias={6: 5.0}, repetition_penalty=2.0)
    given = mx.array(logits)
    # bias, then penalty: token 6 is (0 + 5) / 2 = 2.5 < 3 (penalty first would give 5)
    assert sample(given, rows_for(p, 1, prompt_ids=[6]))[0].token_id == 4
    np.testing.assert_array_equal(np.array(given), logits)  # the caller's logits are left alone


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        sample(mx.zeros((2, 10)), rows_for(sampling(), 3))


# --- temperature, top_k, top_p, min_p -------------------------------------------------------


def entropy(draws: np.ndarray, vocab: int) -> float:
    f = np.bincount(draws, minlength=vocab) / len(draws)
    f = f[f > 0]
    return float(-(f * np.log(f)).sum())


def test_temperature_raises_entropy():
    logits = np.linspace(4.0, -4.0, 32)
    ents = [entropy(draw_many(logits, sampling(temperature=t), 3000), 32) for t in (0.25, 0.7, 1.5, 4.0)]
    assert ents == sorted(ents) and ents[-1] - ents[0] > 1.5, ents
    greedy = draw_many(logits, sampling(temperature=0), 50)
    assert set(greedy.tolist()) == {0}


def test_top_k_one_is_greedy():
    logits = np.random.default_rng(3).normal(size=(8, V)).astype(np.float32)
    res = sample(mx.array(logits), rows_for(sampling(temperature=1.5, top_k=1), 8))
    assert [r.token_id for r in res] == np.argmax(logits, axis=-1).tolist()


@pytest.mark.parametrize("k", [5, CANDIDATES + 44])  # inside the candidates / via the full sort
def test_top_k_never_samples_outside(k):
    logits = np.random.default_rng(4).normal(size=V).astype(np.float32)
    top = set(np.argsort(-logits)[:k].tolist())
    draws = draw_many(logits, sampling(temperature=3.0, top_k=k), 300 if k == 5 else 60)
    assert set(draws.tolist()) <= top
    if k == 5:
        assert set(draws.tolist()) == top


def test_top_p_keeps_the_smallest_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)
    for top_p, expected in ((0.45, {0}), (0.79, {0, 1}), (0.81, {0, 1, 2}), (0.96, {0, 1, 2, 3})):
        draws = draw_many(logits, sampling(temperature=1.0, top_p=top_p), 1000)
        assert set(draws.tolist()) == expected, top_p


@pytest.mark.parametrize("scale", [6.0, 0.05])  # nucleus inside the candidates / far past them
def test_top_p_large_vocab_matches_reference(scale):
    logits = (np.random.default_rng(5).normal(size=V) * scale).astype(np.float32)
    p = sampling(temperature=1.0, top_p=0.9)
    nucleus = support(logits, p)
    assert (len(nucleus) < CANDIDATES) == (scale > 1)
    draws = draw_many(logits, p, 300 if scale > 1 else 60)
    assert set(draws.tolist()) <= support(logits, p, slack=1e-5)
    if scale > 1:  # small nucleus: all of it shows up
        assert set(draws.tolist()) == nucleus


def test_top_k_then_top_p_renormalises():
    # top_k=2 leaves [0.5, 0.3] -> renormalised [0.625, 0.375]; top_p=0.6 keeps only the first
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    draws = draw_many(logits, sampling(temperature=1.0, top_k=2, top_p=0.6), 500)
    assert set(draws.tolist()) == {0}
    draws = draw_many(logits, sampling(temperature=1.0, top_k=2, top_p=0.65), 500)
    assert set(draws.tolist()) == {0, 1}


def test_min_p_excludes_tokens_below_fraction_of_max():
    probs = np.array([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = np.log(probs)
    draws = draw_many(logits, sampling(temperature=1.0, min_p=0.12), 2000)  # cut at 0.048
    assert set(draws.tolist()) == {0, 1, 2, 3}
    draws = draw_many(logits, sampling(temperature=1.0, min_p=0.6), 2000)  # cut at 0.24
    assert set(draws.tolist()) == {0, 1}


@pytest.mark.parametrize("top_k", [0, 4])  # the unsorted path / the truncated (sorted) path
def test_min_p_applies_to_the_temperature_scaled_distribution(top_k):
    # relative to the most likely token: [1, .75, .5, .15, .1] at temperature 1,
    # [1, .866, .707, .387, .316] at 2 (the square root) and [1, .5625, .25, .0225, .01] at 0.5
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.06, 0.04]))
    hot = draw_many(logits, sampling(temperature=2.0, min_p=0.35, top_k=top_k), 2000)
    assert set(hot.tolist()) == {0, 1, 2, 3}  # token 3 is above the cut only after scaling
    cold = draw_many(logits, sampling(temperature=0.5, min_p=0.4, top_k=top_k), 2000)
    assert set(cold.tolist()) == {0, 1}  # token 2 is below the cut only after scaling


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, width=32), min_size=2, max_size=40),
    temperature=st.floats(0.1, 3.0),
    top_k=st.integers(0, 10),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
    seed=st.integers(0, 2**32),
)
# tied in float32 once divided by the temperature (the subnormal rounds to -0): any two may be kept
@example(logits=[0.0, -1.401298464324817e-45, 0.0], temperature=2.0, top_k=0, top_p=0.5, min_p=0.0, seed=0)
def test_draws_stay_in_the_reference_support(logits, temperature, top_k, top_p, min_p, seed):
    p = sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    draws = draw_many(np.array(logits), p, 64, seed0=seed)
    assert set(draws.tolist()) <= support(np.array(logits), p, slack=1e-4)


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampling_matches_softmax_chi_square():
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, 0.2])
    probs = np.exp(log_softmax(logits / 0.8))
    draws = draw_many(logits, sampling(temperature=0.8), 20000, seed0=11)
    # df = 9: P(chi2 > 33.7) = 1e-4; seeded, so not flaky either way
    assert chi_square(np.bincount(draws, minlength=10), probs) < 33.7


def test_blocked_inverse_cdf_matches_softmax_on_an_odd_vocabulary():
    # 3000 = 11 blocks of 256 + 184: tokens spread over blocks, the padded last block included
    rng = np.random.default_rng(13)
    logits = np.full(3000, -np.inf, dtype=np.float32)
    live = np.array([0, 255, 256, 1000, 1500, 2047, 2500, 2815, 2816, 2999])
    logits[live] = rng.normal(size=len(live))
    probs = np.exp(log_softmax(logits[live]))
    draws = np.concatenate(
        [draw_many(logits, sampling(temperature=1.0), 2000, seed0=s) for s in range(0, 8000, 2000)]
    )
    assert set(draws.tolist()) <= set(live.tolist())
    counts = np.array([(draws == t).sum() for t in live])
    assert chi_square(counts, probs) < 33.7  # df = 9: P(chi2 > 33.7) = 1e-4


def test_truncated_sampling_matches_renormalised_distribution():
    # top_p in the candidate path (vocabulary larger than the candidates): the nucleus, renormalised
    rng = np.random.default_rng(12)
    logits = np.full(4 * CANDIDATES, -30.0, dtype=np.float32)
    head = rng.permutation(len(logits))[:8]
    logits[head] = np.array([3.0, 2.5, 2.2, 2.0, 1.0, 0.5, 0.0, -1.0])
    p = sampling(temperature=1.0, top_p=0.8)
    nucleus = sorted(support(logits, p), key=lambda t: -logits[t])
    assert 2 <= len(nucleus) < 8
    probs = np.exp(log_softmax(logits[nucleus]))
    draws = draw_many(logits, p, 8000, seed0=21)
    assert set(draws.tolist()) <= set(nucleus)
    counts = np.array([(draws == t).sum() for t in nucleus])
    assert chi_square(counts, probs) < 25.0  # df <= 6: P(chi2 > 25) < 4e-4


# --- penalties, bias, mask ---------------------------------------------------------------------


def processed(logits: np.ndarray, row: SamplerRow) -> np.ndarray:
    """The sampler's reported log-distribution over a small vocabulary (top_logprobs = all)."""
    res = sample(mx.array(logits[None, :].astype(np.float32)), [row])[0]
    out = np.full(len(logits), -np.inf)
    for t, lp in res.top:
        out[t] = lp
    return out


def test_penalties_exact_logit_math():
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, -0.5], dtype=np.float32)
    prompt, output = [0, 1, 1], [3, 4, 3, 3, 6]
    p = sampling(
        temperature=1.0,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.25,
        logprobs=True,
        top_logprobs=8,
    )
    got = processed(logits, SamplerRow(p, make_rng(0), prompt, output))
    want = logits.astype(np.float64).copy()
    for t in {0, 1, 3, 4, 6}:  # repetition: prompt + output
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    counts = {3: 3, 4: 1, 6: 1}  # frequency / presence: output only
    for t, c in counts.items():
        want[t] -= 0.25 * c + 0.4
    np.testing.assert_allclose(got, log_softmax(want), atol=1e-5)


def test_repetition_penalty_lowers_repeated_token_probability():
    logits = np.array([1.0, 1.0, -1.0, -1.0], dtype=np.float32)
    p = sampling(temperature=1.0, repetition_penalty=1.5, logprobs=True, top_logprobs=4)
    base = processed(logits, SamplerRow(sampling(logprobs=True, top_logprobs=4), make_rng(0)))
    pen = processed(logits, SamplerRow(p, make_rng(0), prompt_ids=[0, 2]))
    assert pen[0] < base[0] and pen[2] < base[2]  # both signs pushed down
    assert pen[1] > base[1] and pen[3] > base[3]  # the others gain the mass


def test_presence_and_frequency_ignore_the_prompt():
    logits = np.zeros(4, dtype=np.float32)
    p = sampling(presence_penalty=1.0, frequency_penalty=1.0, logprobs=True, top_logprobs=4)
    got = processed(logits, SamplerRow(p, make_rng(0), prompt_ids=[0, 1, 2, 3], output_ids=[]))
    np.testing.assert_allclose(got, np.log(0.25), atol=1e-6)


def test_logit_bias_bans_and_forces():
    logits = np.linspace(5.0, 0.0, 50)
    banned = draw_many(logits, sampling(temperature=1.0, logit_bias={0: -100.0, 1: -100.0}), 500)
    assert not {0, 1} & set(banned.tolist())
    forced = draw_many(logits, sampling(temperature=1.0, logit_bias={42: 100.0}), 500)
    assert set(forced.tolist()) == {42}
    string_keys = draw_many(logits, sampling(temperature=1.0, logit_bias={"42": 100.0}), 50)
    assert set(string_keys.tolist()) == {42}


def test_mask_excludes():
    logits = np.random.default_rng(6).normal(size=V).astype(np.float32)
    allowed = np.zeros(V, dtype=bool)
    allowed[[10, 20, 30]] = True
    for p in (sampling(temperature=2.0), sampling(temperature=0), sampling(top_p=0.5)):
        draws = draw_many(logits, p, 100, allowed=allowed)
        assert set(draws.tolist()) <= {10, 20, 30}
    shorter = np.ones(100, dtype=bool)  # a model vocabulary padded past the tokenizer's
    assert set(draw_many(logits, sampling(temperature=5.0), 100, allowed=shorter).tolist()) <= set(range(100))
    with pytest.raises(ValueError):
        draw_many(logits, sampling(), 1, allowed=np.zeros(V, dtype=bool))


# --- logprobs --------------------------------------------------------------------------


def test_logprobs_are_log_softmax_and_top_sorted():
    logits = np.random.default_rng(7).normal(size=(3, V)).astype(np.float32) * 3
    params = [
        sampling(temperature=0, logprobs=True, top_logprobs=5),
        sampling(temperature=0.7, top_p=0.9, logprobs=True, top_logprobs=20),
        sampling(temperature=1.0, logprobs=True),
    ]
    res = sample(mx.array(logits), [SamplerRow(p, make_rng(i)) for i, p in enumerate(params)])
    for i, r in enumerate(res):
        ref = log_softmax(logits[i])  # temperature 1, whatever the sampling temperature
        assert r.logprob == pytest.approx(ref[r.token_id], abs=1e-4)
        assert len(r.top) == params[i].top_logprobs
        assert [t for t, _ in r.top] == np.argsort(-ref)[: len(r.top)].tolist()
        for t, lp in r.top:
            assert lp == pytest.approx(ref[t], abs=1e-4)
        assert [lp for _, lp in r.top] == sorted((lp for _, lp in r.top), reverse=True)


def test_no_logprobs_unless_asked():
    res = sample(mx.zeros((2, 10)), rows_for(sampling(temperature=0.5), 2))
    assert all(r.logprob is None and r.top == [] for r in res)
    assert isinstance(res[0], SampleResult)


def test_logprobs_leave_out_banned_alternatives():
    allowed = np.zeros(50, dtype=bool)
    allowed[[1, 2]] = True
    p = sampling(temperature=0, logprobs=True, top_logprobs=5)
    r = sample(mx.zeros((1, 50)), [SamplerRow(p, make_rng(0), allowed=allowed)])[0]
    assert sorted(t for t, _ in r.top) == [1, 2]
    assert r.logprob == pytest.approx(math.log(0.5))


# --- seeds ---------------------------------------------------------------------------------


TARGETS = [
    sampling(temperature=0.8, seed=1),
    sampling(temperature=1.0, top_p=0.9, seed=2),
    sampling(temperature=0.7, top_k=40, min_p=0.05, seed=3),
    sampling(temperature=1.2, top_p=0.95, repetition_penalty=1.2, logprobs=True, top_logprobs=3, seed=4),
]
OTHERS = [
    sampling(temperature=0),
    sampling(temperature=0.5, top_k=5),
    sampling(temperature=1.3, top_p=0.5, presence_penalty=1.0),
    sampling(temperature=2.0, min_p=0.1, logit_bias={1: 5.0}),
    sampling(temperature=1.0, top_k=CANDIDATES * 2),
    sampling(temperature=0.9, top_p=0.99, frequency_penalty=0.5),
    sampling(temperature=0.3, logprobs=True, top_logprobs=2),
]


def step_logits(step: int, width: int) -> np.ndarray:
    # 4096 wide: past the candidates and the inverse-CDF blocks, so every path is taken
    rng = np.random.default_rng(1000 + step)
    return (rng.normal(size=(width, 4096)) * rng.uniform(0.1, 4.0)).astype(np.float32)


@pytest.mark.parametrize("target", TARGETS)
def test_seed_is_independent_of_batch(target):
    steps, position = 50, 5
    alone_rng, batch_rng = make_rng(target.seed), make_rng(target.seed)
    others = [make_rng(100 + i) for i in range(len(OTHERS))]
    alone_out: list[int] = []
    batch_out: list[int] = []
    for step in range(steps):
        logits = step_logits(step, 1 + len(OTHERS))  # row 0 is the target's logits in both runs
        alone = sample(mx.array(logits[:1]), [SamplerRow(target, alone_rng, [1, 2, 3], alone_out)])[0]
        rows = [SamplerRow(p, r, [1, 2, 3], []) for p, r in zip(OTHERS, others, strict=True)]
        rows.insert(position, SamplerRow(target, batch_rng, [1, 2, 3], batch_out))
        batched = np.concatenate([logits[1 : 1 + position], logits[:1], logits[1 + position :]])
        res = sample(mx.array(batched), rows)[position]
        assert res.token_id == alone.token_id, step
        assert res.logprob == alone.logprob
        alone_out.append(alone.token_id)
        batch_out.append(res.token_id)
    assert len(set(alone_out)) > 5  # really sampling


def test_different_seeds_differ_and_unseeded_is_fresh():
    logits = mx.array(step_logits(0, 1))

    def run(rng) -> list[int]:
        return [sample(logits, [SamplerRow(sampling(temperature=1.0), rng)])[0].token_id for _ in range(20)]

    assert run(make_rng(1)) == run(make_rng(1))
    assert run(make_rng(1)) != run(make_rng(2))
    assert run(make_rng(None)) != run(make_rng(None))

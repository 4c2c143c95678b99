"""Tests for specdec_jax.sampling: processed laws vs plain numpy references."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_jax import rng
from specdec_jax.sampling import (
    PenaltyCounts,
    RowSampling,
    SamplingParams,
    first_argmax,
    process_logits,
    sample,
    token_counts,
)
from specdec_jax.verify import verify_stochastic
from specdec_jax.verify_tree import verify_tree_stochastic

V = 50
# Jitted: one compile per shape and flag set instead of one per op keeps the file fast.
process_jit = jax.jit(process_logits)
sample_jit = jax.jit(sample)
token_counts_jit = jax.jit(token_counts, static_argnums=2)


def random_logits(seed, shape=(2, 3, V), scale=3.0):
    return np.random.default_rng(seed).normal(scale=scale, size=shape).astype(np.float32)


def run(logits, params, counts=None):
    """process_logits with one SamplingParams (or one per row), as numpy."""
    logits = np.asarray(logits, np.float32)
    rows = RowSampling.from_params(params, logits.shape[0])
    return np.asarray(process_jit(jnp.asarray(logits), rows, counts))


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_penalize(logits, context, generated, params):
    """Penalties on one logit vector, one token at a time: the HF/CTRL repetition penalty over
    the whole context's counts, the OpenAI/vLLM presence and frequency penalties over the
    generated tokens' counts."""
    out = np.array(logits, np.float64)
    for v in range(out.shape[-1]):
        if context[v] > 0:
            rp = params.repetition_penalty
            out[v] = out[v] / rp if out[v] > 0 else out[v] * rp
        if generated[v] > 0:
            out[v] -= params.presence_penalty
        out[v] -= params.frequency_penalty * generated[v]
    return out


def np_top_p_keep(logits, p):
    """Smallest set of top tokens whose mass is >= p (logits without ties)."""
    order = np.argsort(-logits)
    probs = softmax(logits.astype(np.float64))[order]
    mass_before = np.cumsum(probs) - probs
    keep = np.zeros(logits.shape, bool)
    keep[order[mass_before < p]] = True
    return keep


def assert_valid_law(probs):
    assert np.all(probs >= 0)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-5)


# --- SamplingParams -------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", float("-inf")),
    ],
)
def test_invalid_params_raise_naming_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be .*, got {value!r}$"):
        SamplingParams(**{field: value})


def test_params_defaults_greedy_and_hashable():
    p = SamplingParams()
    assert p.is_greedy and not SamplingParams(temperature=0.5).is_greedy
    assert hash(p) == hash(SamplingParams())
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0


def test_from_params_broadcast_and_length_check():
    rows = RowSampling.from_params(SamplingParams(temperature=0.5, top_k=3), 4)
    np.testing.assert_array_equal(rows.top_k, [3, 3, 3, 3])
    assert rows.temperature.dtype == jnp.float32 and rows.top_k.dtype == jnp.int32
    with pytest.raises(ValueError, match="batch_size 3"):
        RowSampling.from_params([SamplingParams()] * 2, 3)


def test_static_flags_ignore_greedy_rows():
    rows = RowSampling.from_params(
        [SamplingParams(top_k=5, top_p=0.5, min_p=0.1), SamplingParams(temperature=1.0)], 2
    )
    assert rows.any_sampled
    assert not (rows.use_top_k or rows.use_top_p or rows.use_min_p or rows.use_penalties)
    rows = RowSampling.from_params(SamplingParams(presence_penalty=0.5), 2)
    assert rows.use_penalties and not rows.any_sampled


# --- process_logits: one transform at a time --------------------------------------


def test_greedy_is_argmax_one_hot_first_on_ties():
    logits = random_logits(0)
    logits[1, 2, [7, 30]] = logits[1, 2].max() + 1.0  # tie: first index wins
    probs = run(logits, SamplingParams())
    expected = np.eye(V, dtype=np.float32)[logits.argmax(axis=-1)]
    np.testing.assert_array_equal(probs, expected)
    assert probs[1, 2, 7] == 1.0


def test_first_argmax_is_numpys_argmax_with_ties_and_infinities():
    x = random_logits(1, shape=(3, 4, V))
    x[0, 0, [3, 9, 40]] = x[0, 0].max() + 2.0  # a three-way tie: the first wins
    x[1, 1, :] = -np.inf  # nothing allowed: index 0, as numpy
    x[2, 3, [0, V - 1]] = np.inf  # two infinite maxima
    x[2, 2, V - 1] = x[2, 2].max() + 1.0  # the last index
    got = np.asarray(jax.jit(first_argmax)(x))
    np.testing.assert_array_equal(got, x.argmax(axis=-1))
    assert got[0, 0] == 3 and got[1, 1] == 0 and got[2, 3] == 0 and got[2, 2] == V - 1


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_matches_scaled_softmax(temperature):
    logits = random_logits(1)
    probs = run(logits, SamplingParams(temperature=temperature))
    np.testing.assert_allclose(probs, softmax(logits / temperature), rtol=1e-5, atol=1e-7)


def test_tiny_temperature_is_finite_and_concentrates_on_argmax():
    logits = random_logits(2)
    probs = run(logits, SamplingParams(temperature=1e-30))
    np.testing.assert_array_equal(probs, np.eye(V, dtype=np.float32)[logits.argmax(-1)])


@pytest.mark.parametrize("k", [1, 3, 17, V])
def test_top_k_keeps_exactly_k(k):
    logits = random_logits(3)
    probs = run(logits, SamplingParams(temperature=1.0, top_k=k))
    kept = probs > 0
    np.testing.assert_array_equal(kept.sum(axis=-1), k)
    kth = np.sort(logits, axis=-1)[..., -k][..., None]
    np.testing.assert_array_equal(kept, logits >= kth)
    np.testing.assert_allclose(probs, softmax(np.where(kept, logits, -np.inf)), rtol=1e-5)


def test_top_k_keeps_ties_at_threshold():
    logits = random_logits(3)
    order = np.argsort(-logits[0, 0])
    logits[0, 0, order[2]] = logits[0, 0, order[1]]  # 2nd and 3rd largest tie
    probs = run(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_array_equal(np.flatnonzero(probs[0, 0]), np.sort(order[:3]))
    np.testing.assert_array_equal((probs[:, 1:] > 0).sum(-1), 2)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_keeps_smallest_set_with_mass_p(p):
    logits = random_logits(4, scale=2.0)
    probs = run(logits, SamplingParams(temperature=1.0, top_p=p))
    for idx in np.ndindex(logits.shape[:-1]):
        keep = np_top_p_keep(logits[idx], p)
        np.testing.assert_array_equal(probs[idx] > 0, keep)
        assert softmax(logits[idx].astype(np.float64))[keep].sum() >= p
        expected = softmax(np.where(keep, logits[idx], -np.inf))
        np.testing.assert_allclose(probs[idx], expected, rtol=1e-5)


def test_top_p_one_keeps_every_token_even_below_f32_resolution():
    # Tail mass exp(-60) is far below f32 eps: the f32 cumsum reaches 1 at the
    # top token, so only the explicit top_p == 1 rule keeps the tail.
    logits = np.full((2, 3, V), -60.0, np.float32)
    logits[:, :, 0] = 0.0
    params = [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0)]
    probs = run(logits, params)
    assert np.all(probs[1] > 0)
    np.testing.assert_array_equal(probs[0], np.eye(V)[[0, 0, 0]])


def test_top_p_always_keeps_top_token():
    logits = random_logits(5)
    probs = run(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    np.testing.assert_array_equal(probs, np.eye(V, dtype=np.float32)[logits.argmax(-1)])


@pytest.mark.parametrize("min_p", [0.01, 0.2, 0.7, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.5])
def test_min_p_on_scaled_law(min_p, temperature):
    logits = random_logits(6, scale=1.5)
    probs = run(logits, SamplingParams(temperature=temperature, min_p=min_p))
    scaled = softmax(logits.astype(np.float64) / temperature)
    keep = scaled >= min_p * scaled.max(axis=-1, keepdims=True)
    np.testing.assert_array_equal(probs > 0, keep)
    expected = softmax(np.where(keep, logits / temperature, -np.inf))
    np.testing.assert_allclose(probs, expected, rtol=1e-5)


def test_top_k_then_top_p_then_min_p_compose_like_hf():
    logits = random_logits(7, scale=1.0)
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.6, min_p=0.3)
    probs = run(logits, params)
    for idx in np.ndindex(logits.shape[:-1]):
        x = logits[idx].astype(np.float64) / 0.8
        x = np.where(x >= np.sort(x)[-10], x, -np.inf)
        x = np.where(np_top_p_keep(x, 0.6), x, -np.inf)
        law = softmax(x)
        x = np.where(law >= 0.3 * law.max(), x, -np.inf)
        np.testing.assert_allclose(probs[idx], softmax(x), rtol=1e-5, atol=1e-8)


def test_masked_entries_are_exactly_zero_and_laws_sum_to_one():
    logits = random_logits(8)
    params = [
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=0.7, top_p=0.5, min_p=0.2),
    ]
    probs = run(logits, params)
    assert_valid_law(probs)
    assert probs.dtype == np.float32
    assert np.all((probs == 0).sum(axis=-1) >= V // 2)  # masked tokens really are 0.0


def test_mixed_batch_rows_match_alone():
    logits = random_logits(9, (4, 3, V))
    context = np.random.default_rng(9).poisson(0.3, size=(4, 3, V)).astype(np.float32)
    counts = PenaltyCounts(context, context)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=0.9, top_p=0.7, repetition_penalty=1.3),
    ]
    together = run(logits, params, counts)
    for b, p in enumerate(params):
        # Alone: a batch of 2 copies of row b (the default shape, so these
        # compiles are shared with the tests above).
        alone_counts = PenaltyCounts(*[np.repeat(c[b : b + 1], 2, 0) for c in counts]) if p.has_penalties else None
        alone = run(np.repeat(logits[b : b + 1], 2, 0), p, alone_counts)
        np.testing.assert_allclose(together[b], alone[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(together[0], np.eye(V)[logits[0].argmax(-1)])
    np.testing.assert_array_equal((together[2] > 0).sum(-1), 3)


def test_rank_two_logits():
    logits = random_logits(10, (3, V))
    probs = run(logits, SamplingParams(temperature=1.0, top_k=5))
    np.testing.assert_array_equal((probs > 0).sum(-1), 5)


# --- penalties and counts -------------------------------------------------------


def test_token_counts_match_bincount():
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, V, size=(4, 30)).astype(np.int32)
    tokens[3, 20:] = -1  # padding may hold anything
    length = np.array([30, 0, 7, 20], np.int32)
    start = np.array([5, 0, 7, 19], np.int32)
    counts = np.asarray(token_counts_jit(jnp.asarray(tokens), jnp.asarray(length), V))
    spans = np.asarray(token_counts_jit(jnp.asarray(tokens), jnp.asarray(length), V, jnp.asarray(start)))
    for b in range(4):
        np.testing.assert_array_equal(counts[b], np.bincount(tokens[b, : length[b]], minlength=V))
        np.testing.assert_array_equal(spans[b], np.bincount(tokens[b, start[b] : length[b]], minlength=V))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.4),
        SamplingParams(repetition_penalty=0.7, temperature=0.9),
        SamplingParams(presence_penalty=0.8, temperature=1.0),
        SamplingParams(frequency_penalty=0.3, temperature=1.1),
        SamplingParams(
            temperature=0.8, repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=0.4
        ),
    ],
)
def test_penalties_with_position_counts_match_reference(params):
    rng = np.random.default_rng(12)
    batch, hist_len, gamma = 3, 12, 4
    small_vocab = 10  # small, so tokens repeat and counts reach 2 and more
    logits = rng.normal(scale=2.0, size=(batch, gamma + 1, small_vocab)).astype(np.float32)
    history = rng.integers(0, small_vocab, size=(batch, hist_len)).astype(np.int32)
    length = np.array([12, 5, 1], np.int32)
    prompt_len = np.array([7, 5, 1], np.int32)  # row 1 and 2: nothing generated yet
    drafts = rng.integers(0, small_vocab, size=(batch, gamma)).astype(np.int32)

    hist = jax.jit(PenaltyCounts.of_history, static_argnums=3)(
        jnp.asarray(history), jnp.asarray(length), jnp.asarray(prompt_len), small_vocab)
    counts = jax.jit(PenaltyCounts.at_positions)(hist, jnp.asarray(drafts))
    probs = run(logits, params, counts)

    for b in range(batch):
        for s in range(gamma + 1):
            context = np.bincount(np.concatenate([history[b, : length[b]], drafts[b, :s]]), minlength=small_vocab)
            generated = np.bincount(np.concatenate([history[b, prompt_len[b] : length[b]], drafts[b, :s]]),
                                    minlength=small_vocab)
            np.testing.assert_array_equal(counts.context[b, s], context)
            np.testing.assert_array_equal(counts.generated[b, s], generated)
            x = np_penalize(logits[b, s], context, generated, params)
            if params.is_greedy:
                expected = np.eye(small_vocab)[x.argmax()]
            else:
                expected = softmax(x / params.temperature)
            np.testing.assert_allclose(probs[b, s], expected, rtol=1e-5, atol=1e-7)


def test_penalties_without_counts_raise():
    rows = RowSampling.from_params(SamplingParams(frequency_penalty=0.1), 1)
    with pytest.raises(ValueError, match="counts"):
        process_logits(jnp.zeros((1, 1, V)), rows)


# --- static flags: unused transforms are not compiled in ---------------------


def jaxpr_text(params, batch=2):
    rows = RowSampling.from_params(params, batch)
    logits = jnp.zeros((batch, 3, V))
    counts = PenaltyCounts(jnp.zeros((batch, 3, V)), jnp.zeros((batch, 3, V)))
    return str(jax.make_jaxpr(jax.jit(process_logits))(logits, rows, counts))


def test_no_sort_without_top_k_or_top_p():
    sampled = SamplingParams(temperature=1.0, min_p=0.1, presence_penalty=0.3)
    greedy_top_p = SamplingParams(top_p=0.5)  # greedy: its top_p is ignored
    text = jaxpr_text([sampled, greedy_top_p])
    assert "sort" not in text and "cumsum" not in text
    assert "sort" in jaxpr_text(SamplingParams(temperature=1.0, top_p=0.9))
    assert "sort" in jaxpr_text(SamplingParams(temperature=1.0, top_k=5))


def test_all_greedy_batch_skips_sampling_path():
    def uses(primitive, text):
        return re.search(rf"= {primitive}\b", text) is not None

    text = jaxpr_text(SamplingParams())
    assert not uses("exp", text) and not uses("div", text) and uses("reduce_max", text)  # first_argmax
    assert uses("exp", jaxpr_text(SamplingParams(temperature=1.0)))


# --- property test ----------------------------------------------------------------


row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.05, 0.7, 1.0, 3.0]),
    top_k=st.integers(0, 10),
    top_p=st.sampled_from([1e-3, 0.3, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.1, 0.9, 1.0]),
    repetition_penalty=st.sampled_from([0.5, 1.0, 1.5]),
    presence_penalty=st.sampled_from([-1.0, 0.0, 1.0]),
    frequency_penalty=st.sampled_from([-0.5, 0.0, 0.5]),
)


@settings(max_examples=30, deadline=None)
@given(params=st.lists(row_params, min_size=2, max_size=2), seed=st.integers(0, 2**32 - 1))
def test_property_valid_law_and_argmax_kept(params, seed):
    rng = np.random.default_rng(seed)
    shape = (2, 2, 8)
    logits = (rng.normal(size=shape) * rng.choice([0.1, 3.0, 30.0])).astype(np.float32)
    counts = rng.integers(0, 3, size=shape).astype(np.float32)
    # Every transform compiled in (one compile for all examples, and the path
    # where rows that do not use a transform must pass through it unchanged).
    rows = RowSampling.from_params(params, 2).replace(
        use_top_k=True, use_top_p=True, use_min_p=True, use_penalties=True, any_sampled=True
    )
    generated = np.minimum(counts, rng.integers(0, 3, size=shape)).astype(np.float32)  # a part of the context
    probs = np.asarray(process_jit(jnp.asarray(logits), rows, PenaltyCounts(jnp.asarray(counts), jnp.asarray(generated))))
    assert_valid_law(probs)
    for idx in np.ndindex(shape[:-1]):
        x = np_penalize(logits[idx], counts[idx], generated[idx], params[idx[0]])
        assert probs[idx][np.argmax(x.astype(np.float32))] > 0


# --- sample -----------------------------------------------------------------------


N_DRAWS = 100_000


def draw(seed, probs):
    """One draw from each row of f32[N_DRAWS,5] (one shape: one compile for both tests)."""
    keys = jax.random.split(jax.random.key(seed), N_DRAWS)
    return np.asarray(sample_jit(keys, jnp.asarray(probs)))


def test_sample_chi_square():
    law = np.array([0.05, 0.15, 0.2, 0.25, 0.35], np.float32)
    draws = draw(0, np.broadcast_to(law, (N_DRAWS, 5)))
    assert draws.dtype == np.int32
    observed = np.bincount(draws, minlength=5)
    # Significance 1e-4: a correct sampler fails for at most 1 seed in 10,000
    # (the seed is fixed, so the test is deterministic).
    assert scipy.stats.chisquare(observed, law * N_DRAWS).pvalue > 1e-4


def test_sample_never_draws_masked_tokens():
    logits = random_logits(13, (4, 5))
    params = [SamplingParams(), SamplingParams(temperature=2.0, top_k=3)] * 2
    probs = run(logits, params)
    draws = draw(1, np.tile(probs, (N_DRAWS // 4, 1))).reshape(-1, 4)
    assert np.all(np.take_along_axis(probs, draws.T, axis=1) > 0)
    np.testing.assert_array_equal(draws[:, 0], logits[0].argmax())
    assert len(np.unique(draws[:, 1])) == 3


def test_the_verifiers_draw_bonus_tokens_with_sample():
    """`sample` is the package's one categorical draw: a chain's bonus after no drafts, and a tree's
    after no nodes, is `sample` of the target's law under the position's RESIDUAL key."""
    keys = rng.position_keys(jax.random.key(3), jnp.arange(4), jnp.zeros((4, 3), jnp.int32) + jnp.arange(3))
    law = jax.nn.softmax(jnp.asarray(random_logits(5, (4, 3, 7))), axis=-1)
    expected = np.asarray(sample(rng.for_purpose(keys[:, 0], rng.Purpose.RESIDUAL), law[:, 0]))
    drafts, none = jnp.zeros((4, 2), jnp.int32), jnp.zeros((4,), jnp.int32)
    chain = verify_stochastic(keys, drafts, None, law, none)
    tree = verify_tree_stochastic(keys, drafts, jnp.full((4, 2), -1, jnp.int32), jnp.zeros((4, 2), bool), None, law)
    np.testing.assert_array_equal(np.asarray(chain.tokens[:, 0]), expected)
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 0]), expected)


def test_accept_uniforms_lie_in_tiny_to_one_one_per_key():
    keys = rng.for_purpose(jax.random.split(jax.random.key(4), 12).reshape(3, 4), rng.Purpose.ACCEPT)
    u = np.asarray(rng.accept_uniforms(keys))
    assert u.shape == (3, 4) and u.dtype == np.float32
    assert np.all(u >= np.finfo(np.float32).tiny) and np.all(u < 1.0)
    alone = jax.random.uniform(keys[1, 2], minval=np.finfo(np.float32).tiny, maxval=1.0)
    assert u[1, 2] == float(alone)

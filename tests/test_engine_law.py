"""The sampling law end to end: spec-decoded sequences follow the target's own law.

A target and a draft over a 6-token vocabulary; the exact law of the first NEW
generated tokens (6^3 = 216 sequences; 6^4 = 1296 for the gamma 3 cases, whose
budget must leave room for three drafts in a round) comes from enumeration: one
teacher-forced forward pass over every prompt + continuation, the processed law
at temperature 1 being the softmax. Each case draws N = 16,384 rows of the same prompt (distinct
row ids, so independent draws) through one batched `generate` call and runs a
chi-square goodness-of-fit test over the 216 cells, cells with expected count
< 5 merged into one. The slow tier runs every case again with FULL_N = 65,536 rows (`LAW_ROWS`):
N rejects a law with 2% of the draft's law mixed in, FULL_N one with 1% (docs/testing.md, "How
strong the law tests are").

Significance 1e-4 per test: a correct engine trips one of the 10 law tests with
probability below 4e-4 on a fresh seed (the seeds here are fixed, so the run is
deterministic). The power check shows a wrong law is rejected by a wide margin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from scipy import stats

from engine_helpers import DecoyTree
from specdec_jax.audit import chi_square, continuation_codes, noisy_copy, sequence_law
from specdec_jax.drafters import EagleConfig, EagleDrafter, MedusaConfig, MedusaDrafter, ModelDrafter, NgramDrafter
from specdec_jax.drafters.eagle import init_eagle
from specdec_jax.engine import ShapePolicy, generate
from specdec_jax.models import Llama, LlamaConfig, random_llama
from specdec_jax.sampling import SamplingParams
from specdec_jax.token_tree import TreeShape

V = 6
NEW = 3
N = 16_384  # rows per law case in the default suite; a power of two: the batch bucket holds no padding rows
FULL_N = 65_536  # the slow tier's rows per case
SIGNIFICANCE = 1e-4
PROMPT = [1, 2, 3, 1, 2]  # the n-gram drafter finds [1, 2] -> 3 1 2 at once
CONFIG = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=8)
SAMPLED = SamplingParams(temperature=1.0)
STOP = 0.5  # the "stop" drafter's chains end after a draft it drew with probability below this


@functools.cache
def target() -> Llama:
    return random_llama(CONFIG, 0)


@functools.cache
def draft() -> Llama:
    """The target's weights plus noise: a draft that is often right but has its own law."""
    return noisy_copy(target())


REDUCED_IDS = np.array([0, 2, 3, 5], np.int32)  # a draft that can never propose tokens 1 and 4


@functools.cache
def reduced_draft() -> tuple[LlamaConfig, dict]:
    """The draft with an output head over REDUCED_IDS only: q is zero on tokens 1 and 4, which the
    target must still produce at its own rate (through residual resampling)."""
    config = dataclasses.replace(CONFIG, output_vocab_size=len(REDUCED_IDS))
    arrays = draft().arrays()
    arrays["lm_head"] = arrays["lm_head"][REDUCED_IDS]
    arrays["vocab_map"] = REDUCED_IDS
    return config, Llama.from_arrays(config, arrays).params()


@functools.cache
def exact_law(model: Llama, new: int = NEW) -> np.ndarray:
    """f64[V^new]: probability of each continuation x1 .. x_new (index sum_i x_i V^(new-1-i))."""
    law = sequence_law(CONFIG, model.params(), PROMPT, new)
    assert law.shape == (V**new,)
    assert abs(law.sum() - 1) < 1e-9
    return law


def eagle_head() -> EagleDrafter:
    """A random EAGLE head reading two target layers (q: its own law, through the target's LM head)."""
    cfg = EagleConfig(CONFIG.hidden_size, V, 32, 2, 1, 8, feature_layers=(0, -1))
    return EagleDrafter(cfg, init_eagle(cfg, jax.random.key(3)))


def medusa_heads() -> MedusaDrafter:
    """Random Medusa heads on the target's final-norm feature (q: each head's law)."""
    rng = np.random.default_rng(4)
    h = CONFIG.hidden_size
    params = {"w": (rng.standard_normal((3, h, h)) / np.sqrt(h)).astype(np.float32),
              "b": rng.standard_normal((3, h)).astype(np.float32)}
    return MedusaDrafter(MedusaConfig(h, V, 3), params)


# gamma "auto": a fixed policy (not a calibration, so the run is deterministic) under which the
# batch's shape changes from round to round as the estimates move
AUTO_POLICY = ShapePolicy((0, 1, 3), (1.0, 1.2, 1.5), (0.0, 0.1, 0.3), prior=0.9)
# decoy tree; rows alike, so that the batch keeps changing between its tree sizes (weighed by rounds left, its
# rows diverge after learn=1.0 and the batch goes plain; the chain policy above keeps the weights)
AUTO_TREE_POLICY = ShapePolicy((0, 2, 7), (1.0, 1.02, 2.0), (0.0, 0.1, 0.1), prior=0.9, learn=1.0, tree=True,
                               weigh_rows=False)


@functools.cache
def spec_samples(drafter_name: str, gamma: int | str, seed: int, new: int = NEW, rows: int = N):
    drafters = {"model": lambda: ModelDrafter(CONFIG, draft().params()), "reduced": lambda: ModelDrafter(*reduced_draft()),
                "stop": lambda: ModelDrafter(CONFIG, draft().params(), stop_below=STOP),
                "eagle-stop": lambda: dataclasses.replace(eagle_head(), stop_below=STOP),
                "ngram": NgramDrafter, "eagle": eagle_head, "medusa": medusa_heads,
                "trie": lambda: NgramDrafter(tree=TreeShape(nodes=6, depth=3, topk=2)),
                "decoy-model": lambda: DecoyTree(ModelDrafter(CONFIG, draft().params()), V, draft().params()),
                "eagle-tree": lambda: dataclasses.replace(eagle_head(), tree=TreeShape(nodes=6, depth=3, topk=2))}
    drafter = drafters[drafter_name]()
    # capacity 16 (the prompt bucket) instead of the default 64: a 4x smaller KV cache
    # for all those rows, several seconds less per call.
    policy = (AUTO_TREE_POLICY if getattr(drafter, "tree", None) else AUTO_POLICY) if gamma == "auto" else None
    out = generate(target(), [PROMPT] * rows, drafter, gamma=gamma, policy=policy, sampling=SAMPLED, max_new_tokens=new,
                   seed=seed, capacity=16)
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (rows, new)
    return continuation_codes(tokens, V), out.metrics


# (id, drafter, gamma, seed, new tokens, in the default suite): a budget of `new` tokens allows at most new - 1
# drafts a round (token trees: gamma None, the tree's node count)
CASES = [("model-g2", "model", 2, 11, 3, True), ("model-g3", "model", 3, 12, 4, False),
         ("ngram-g3", "ngram", 3, 13, 4, True), ("reduced-vocab-g2", "reduced", 2, 14, 3, True),
         ("eagle-g3", "eagle", 3, 15, 4, True), ("medusa-g3", "medusa", 3, 16, 4, True),
         ("model-auto", "model", "auto", 17, 4, False), ("trie", "trie", None, 18, 4, False),
         ("decoy-tree-of-model", "decoy-model", None, 19, 4, False),  # also under auto below
         ("eagle-tree", "eagle-tree", None, 20, 4, False), ("decoy-tree-auto", "decoy-model", "auto", 21, 4, True),
         ("model-stop-g3", "stop", 3, 22, 4, True), ("eagle-stop-g3", "eagle-stop", 3, 23, 4, False)]


def law_cases(cases):
    """pytest params from ``(id, *args, in the default suite)``: each default case with N rows, and every case
    with FULL_N rows in the slow tier (ids ``<id>-<rows>-rows``; an empty id gives ``<rows>-rows``)."""
    for name, *args, default in cases:
        prefix = f"{name}-" if name else ""
        if default:
            yield pytest.param(*args, N, id=f"{prefix}{N}-rows")
        yield pytest.param(*args, FULL_N, id=f"{prefix}{FULL_N}-rows", marks=pytest.mark.slow)


LAW_ROWS = list(law_cases([("", True)]))  # the row counts alone, for law tests with a single case


@pytest.mark.parametrize("drafter, gamma, seed, new, rows", law_cases(CASES))
def test_spec_sampling_follows_the_target_law(drafter, gamma, seed, new, rows):
    codes, metrics = spec_samples(drafter, gamma, seed, new, rows)
    stat, _, pvalue = chi_square(np.bincount(codes, minlength=V**new), exact_law(target(), new))
    assert pvalue > SIGNIFICANCE, f"chi2 {stat:.1f}, p = {pvalue:.2e}"
    # The acceptance path was really exercised: drafts were both accepted and rejected,
    # and rounds verified all gamma drafts (the last one accepted too, now and then).
    assert metrics.draft_tokens > rows and metrics.accepted_tokens > rows / 10, metrics
    if gamma is not None:  # (a tree drafts many nodes per accepted one)
        assert 0.1 < metrics.acceptance_rate < 0.99, metrics
    if gamma == "auto":  # the shape changed between rounds: some verified one draft (two nodes), some three (7)
        assert metrics.width_rounds[1] > 0 and metrics.width_rounds[2] > 0, metrics
        gamma = None if drafter == "decoy-model" else AUTO_POLICY.max_gamma
    if gamma is None:  # a tree: rounds verified nodes at depth 3, and accepted paths of depth 2
        assert metrics.position_proposed[2] > rows / 10 and metrics.position_accepted[1] > 0, metrics
    else:
        assert metrics.position_proposed[gamma - 1] > rows / 10 and metrics.position_accepted[gamma - 1] > 0, metrics
    if drafter.endswith("stop"):  # many chains ended after an unconfident first draft
        assert metrics.position_proposed[1] < 0.8 * metrics.position_proposed[0], metrics
    if drafter == "reduced":  # tokens the draft cannot propose came (from the residual) at the target's rate
        digits = np.stack([codes // V**2, codes // V % V, codes % V])
        assert np.isin(digits, [1, 4]).any(axis=0).mean() > 0.01


def test_chi_square_rejects_a_wrong_law():
    """Power: the same samples against the draft's law (or a tempered target) fail by far."""
    codes, _ = spec_samples("model", 2, 11, NEW, N)  # the arguments of the model-g2 case: its cached samples
    counts = np.bincount(codes, minlength=V**3)
    _, _, p_draft = chi_square(counts, exact_law(draft()))
    assert p_draft < 1e-30
    sharper = exact_law(target()) ** 1.1
    _, _, p_sharper = chi_square(counts, sharper / sharper.sum())
    assert p_sharper < SIGNIFICANCE


@pytest.mark.parametrize("rows, mixed_in, least_power", [(N, 0.02, 0.95), (FULL_N, 0.01, 0.95)])
def test_the_rows_detect_a_small_share_of_a_wrong_law(rows, mixed_in, least_power):
    """How small a bug the chi-square sees at each tier's row count: draws from the target's law with
    `mixed_in` of the draft's law mixed in (as if that share of rows took the draft's token where the target's
    was due), simulated exactly (multinomial counts, 200 trials), are rejected at SIGNIFICANCE in at least
    `least_power` of the trials. Fails if N is lowered below what the docstring above promises."""
    law, wrong = exact_law(target()), exact_law(draft())
    rng = np.random.default_rng(0)
    trials = [chi_square(rng.multinomial(rows, (1 - mixed_in) * law + mixed_in * wrong), law)[2] for _ in range(200)]
    assert np.mean(np.array(trials) < SIGNIFICANCE) >= least_power


def test_chi_square_p_value_matches_scipy():
    rng = np.random.default_rng(0)
    law = rng.dirichlet(np.ones(40))
    counts = rng.multinomial(5000, law)
    stat, dof, pvalue = chi_square(counts, law)
    expected = law * 5000
    keep = expected >= 5
    assert dof == keep.sum() + bool((~keep).any()) - 1  # cells expecting < 5 merged into one
    assert pvalue == pytest.approx(stats.chi2.sf(stat, dof), rel=1e-5)
    assert continuation_codes(np.array([[1, 2, 3]]), V).tolist() == [36 + 12 + 3]

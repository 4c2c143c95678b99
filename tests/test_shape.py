"""gamma "auto": the per-round shape choice (engine.shape) and its calibration (engine.calibration).

References are closed forms (theory.expected_tokens_per_round), hand-computed
choices, and plain decoding; the oracle drafter (acceptance exactly alpha per
position) shows the choice follows acceptance: alpha 0 settles on plain steps,
alpha 1 on the widest shape. Token-tree sizes (node counts, per-node estimates)
get the same checks, and the target as its own tree draft settles on the
whole tree.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine, theory
from specdec_jax.drafters.model import CHAIN_ACCEPTANCE
from specdec_jax.engine import ShapePolicy, calibration, shape
from specdec_jax.engine.request import resolve_gamma
from specdec_jax.sampling import SamplingParams

GAMMAS = (0, 1, 2, 4)
CPU_COSTS = (1.0, 1.38, 1.46, 1.79)  # Tv(g + 1) / T1 measured on the project's CPU (docs/design.md section 11)


def policy(draft=(0.0, 0.0, 0.0, 0.0), verify=CPU_COSTS, **estimator) -> ShapePolicy:
    return ShapePolicy(GAMMAS, verify, draft, **estimator)


# The oracle's costs: one draft pays from a > 0.4; a prior of 0.7 (not the default 0.5) opens with the widest
# chain. One compiled program serves every oracle alpha under them (the policy is part of the program), and the
# oracle runs under penalised greedy decoding (PENALTIES) throughout, so that every oracle test here shares it: the
# exact oracle drafts the penalised argmaxes, so its acceptance is still alpha.
ORACLE_COSTS = policy((0.0, 0.1, 0.2, 0.4), verify=(1.0, 1.3, 1.5, 1.8), prior=0.7)
PENALTIES = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)


def oracle_auto(alpha: float) -> engine.GenerationResult:
    return engine.generate(H.target(), H.RAGGED, H.oracle(alpha), policy=ORACLE_COSTS, max_new_tokens=H.MAX_NEW,
                           sampling=PENALTIES)


def penalised_plain() -> list[list[int]]:
    return engine.generate(H.target(), H.RAGGED, max_new_tokens=H.MAX_NEW, sampling=PENALTIES).tokens


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
def test_expected_tokens_match_the_closed_form(alpha):
    acceptance = jnp.full((2, 4), alpha)
    got = np.asarray(shape.expected_tokens(acceptance, jnp.array([4, 1]), GAMMAS))
    want = [theory.expected_tokens_per_round(alpha, g) for g in GAMMAS]
    np.testing.assert_allclose(got[0], want, rtol=1e-6)
    np.testing.assert_allclose(got[1], [want[0]] + [want[1]] * 3, rtol=1e-6)  # room for one draft only


def test_choices_follow_acceptance_and_costs():
    live, room = jnp.array([True]), jnp.array([4])
    # a = 0.8: E = 1, 1.8, 2.44, 3.36 -> per T1: 1, 1.30, 1.67, 1.88: the widest chain
    assert int(shape.choose_draft(policy((0, .1, .1, .1)), jnp.full((1, 4), 0.8), live, room)) == 3
    # a = 0.2: E = 1, 1.2, 1.24, 1.25 -> per T1: 1, 0.87, 0.85, 0.70: plain decoding
    assert int(shape.choose_draft(policy((0, .1, .1, .1)), jnp.full((1, 4), 0.2), live, room)) == 0
    # a free drafter always drafts G; the verify choice then decides
    assert int(shape.choose_draft(policy(), jnp.full((1, 4), 0.2), live, room)) == 3
    assert int(shape.choose_verify(policy(), jnp.full((1, 4), 0.2), live, jnp.array([4]), jnp.array(3))) == 0
    # a = (0.9, 0.1, ...): E = 1, 1.9, 1.99, 2.0 -> per T1: 1, 1.377, 1.363, 1.12: one draft
    acceptance = jnp.array([[0.9, 0.1, 0.1, 0.1]])
    assert int(shape.choose_verify(policy(), acceptance, live, jnp.array([4]), jnp.array(3))) == 1
    # ... unless the row found no draft (n-gram miss): then nothing is verified
    assert int(shape.choose_verify(policy(), acceptance, live, jnp.array([0]), jnp.array(3))) == 0
    # finished rows do not count: a good finished row and a bad live row give plain decoding
    two = jnp.array([[0.95] * 4, [0.05] * 4])
    assert int(shape.choose_verify(policy(), two, jnp.array([False, True]), jnp.array([4, 4]), jnp.array(3))) == 0
    # verification never exceeds what was drafted
    assert int(shape.choose_verify(policy(), jnp.full((1, 4), 0.99), live, jnp.array([4]), jnp.array(1))) == 1


def test_a_row_ahead_of_the_batch_stops_widening_it():
    """A batch ends with its last row: a copying row's tokens shorten nothing while a row of free text
    needs a round per token, so weighing rows by rounds left turns the batch plain (hand-computed)."""
    acceptance = jnp.array([[0.95] * 4, [0.05] * 4])
    live, room, found = jnp.array([True, True]), jnp.array([100, 100]), jnp.array([4, 4])
    w = np.asarray(shape.row_weights(policy(), acceptance, live, room))
    # rounds left: 101 / E(4) = 101 / 4.5244 = 22.32 and 101 / 1.0526 = 95.95
    np.testing.assert_allclose(w, [22.324 / 95.953, 1.0], rtol=1e-3)
    # weighted tokens per T1 at gammas 0, 1, 2, 4: 1.233, 1.090, 1.176, 1.176 -> plain
    assert int(shape.choose_verify(policy(), acceptance, w, found, jnp.array(3))) == 0
    # alike, as with weigh_rows off: 2, 2.17, 2.67, 3.11 -> the widest chain
    alike = shape.row_weights(policy(weigh_rows=False), acceptance, live, room)
    np.testing.assert_array_equal(np.asarray(alike), [1.0, 1.0])
    assert int(shape.choose_verify(policy(), acceptance, alike, found, jnp.array(3))) == 3
    # rows alike weigh alike; little budget left weighs little; a finished row weighs 0; a row alone 1
    same = jnp.full((3, 4), 0.5)
    w = np.asarray(shape.row_weights(policy(), same, jnp.array([True, True, False]), jnp.array([100, 10, 100])))
    np.testing.assert_allclose(w, [1.0, 11 / 101, 0.0], rtol=1e-6)
    assert float(shape.row_weights(policy(), same[:1], live[:1], jnp.array([3]))[0]) == 1.0


def test_a_row_that_seldom_finds_drafts_is_the_batch_last_row():
    """Prompt lookup finds nothing in most rounds of free text, so that row's estimates are seldom
    observed and stay near the prior; weighed by its share of rounds with drafts, it expects about a
    token a round and is the row the batch waits for (hand-computed)."""
    p = policy(learn=0.25)
    share = shape.update_found(p, jnp.array([1.0, 1.0, 0.5]), jnp.array([True, True, False]), jnp.array([3, 0, 0]))
    np.testing.assert_allclose(np.asarray(share), [1.0, 0.75, 0.5])  # row 2 did not draft: unchanged
    acceptance, live, room = jnp.full((2, 4), 0.7), jnp.array([True, True]), jnp.array([100, 100])
    # E(4) = 1 + 0.7 + 0.49 + 0.343 + 0.2401 = 2.7731; shares 1 and 0.1: E 2.7731 and 1.1773
    w = np.asarray(shape.row_weights(p, acceptance, live, room, jnp.array([1.0, 0.1])))
    np.testing.assert_allclose(w, [1.1773 / 2.7731, 1.0], rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(shape.row_weights(p, acceptance, live, room)), [1.0, 1.0])


def test_estimates_learn_what_was_verified_and_drift_where_nothing_was():
    p = policy(prior=0.5, learn=0.5, relax=0.1, follow=0.2)
    a = jnp.array([[0.6, 0.6, 0.6, 0.6], [0.6, 0.6, 0.6, 0.6], [0.2, 0.8, 0.6, 0.6]])
    # row 0: 3 drafts, 1 accepted (positions 1, 2 observed); row 1: finished; row 2: no drafts
    new = np.asarray(shape.update(p, a, jnp.array([True, False, True]), jnp.array([3, 3, 0]), jnp.array([1, 0, 0])))
    # unobserved depths drift toward max(prior, the depth above)
    np.testing.assert_allclose(new[0], [0.8, 0.3, 0.6 + 0.2 * (0.5 - 0.6), 0.6], rtol=1e-6)
    np.testing.assert_allclose(new[1], [0.6 + 0.1 * (0.5 - 0.6), 0.6, 0.6, 0.6], rtol=1e-6)
    np.testing.assert_allclose(new[2], [0.2 + 0.1 * 0.3, 0.8 + 0.2 * (0.5 - 0.8), 0.6 + 0.2 * 0.2, 0.6], rtol=1e-6)


def test_bad_policies_and_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="ascend strictly from 0"):
        ShapePolicy((1, 2), (1.0, 1.1), (0.0, 0.0))
    with pytest.raises(ValueError, match="one entry per gamma"):
        ShapePolicy((0, 1), (1.0,), (0.0, 0.0))
    with pytest.raises(ValueError, match="learn"):
        policy(learn=2.0)
    with pytest.raises(ValueError, match="needs a drafter"):
        engine.generate(H.target(), H.RAGGED, gamma="auto")
    with pytest.raises(ValueError, match="exclude each other"):
        engine.generate(H.target(), H.RAGGED, H.ngram(), gamma=3, policy=policy())
    with pytest.raises(ValueError, match="int >= 0 or 'auto'"):
        engine.generate(H.target(), H.RAGGED, H.ngram(), gamma="fast")


@pytest.mark.parametrize("name", ["ngram", "model"])  # the oracle: test_penalised_greedy_auto_equals_plain_decoding
def test_auto_is_lossless(name):
    drafter = {"ngram": H.ngram, "model": H.model_drafter}[name]()
    costs = {"ngram": policy(), "model": policy((0.05, 0.1, 0.2, 0.4))}[name]
    out = engine.generate(H.target(), H.RAGGED, drafter, policy=costs, max_new_tokens=H.MAX_NEW)
    assert out.tokens == H.reference_no_eos().tokens
    assert sum(out.metrics.width_rounds) == out.loop_rounds


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_penalised_greedy_auto_equals_plain_decoding(alpha):
    """Each width's branch reduces its logits to penalised argmaxes (`round.keeps_logits`): the
    counts it penalises with are the ones of its own columns. The exact oracle drafts penalised
    argmaxes, so at alpha 1 it is accepted through every width the policy runs; at 0.5 the widths
    mix."""
    out = oracle_auto(alpha)
    assert out.tokens == penalised_plain()
    assert out.tokens != H.reference_no_eos().tokens  # the penalties change the output
    if alpha == 1.0:
        assert out.metrics.mean_accepted_length > 3.0, out.metrics
    else:
        assert sum(n > 0 for n in out.metrics.width_rounds) >= 3, out.metrics


def test_a_default_prior_below_the_break_even_is_raised_to_probe():
    """One draft costing 1.7 T1 pays from a = 0.7 (E(1) = 1 + a); two cost 2.21 T1 and pay from
    1 + a + a^2 = 2.21, a = 0.7: the default prior 0.5 would never draft, the raised one drafts in
    the first round and stops once its drafts fail; a given prior is kept as given."""
    dear = ShapePolicy((0, 1, 2), (1.0, 1.5, 1.61), (0.0, 0.2, 0.6))
    assert shape.break_even(dear) == pytest.approx(0.7, abs=1e-3)
    assert dear.prior == pytest.approx(0.7 + shape.PROBE_MARGIN, abs=1e-3)
    live, room = jnp.array([True]), jnp.array([8])
    assert int(shape.choose_draft(dear, dear.initial(1), live, room)) > 0
    failed = shape.update(dear, dear.initial(1), live, jnp.array([1]), jnp.array([0]))
    assert int(shape.choose_draft(dear, failed, live, room)) == 0
    assert ShapePolicy((0, 1, 2), (1.0, 1.5, 1.61), (0.0, 0.2, 0.6), prior=0.5).prior == 0.5
    assert policy((0.0, 0.1, 0.2, 0.4), verify=(1.0, 1.1, 1.2, 1.3)).prior == shape.CHAIN_PRIOR  # cheap: as it was
    # a tree drafts its whole proposal whatever it verifies: 3 nodes for 2.5 T1 pay from 1 + a + a^2 + a^3 = 2.5
    tree = ShapePolicy((0, 3), (1.0, 1.5), (0.0, 1.0), tree=True)
    assert shape.break_even(tree) == pytest.approx(0.6914, abs=1e-3)
    assert shape.break_even(ShapePolicy((0, 1), (1.0, 2.5), (0.0, 0.0))) == 1.0  # never pays


def test_auto_turns_speculation_off_when_drafts_fail_and_on_when_they_land():
    bad = oracle_auto(0.0)
    # The rounds priced by the policy's own costs (each width at its drafting and verify cost) stay within 30% of
    # plain decoding's: mostly plain steps and short probes. Each row probes again a few rounds after a failure
    # (the default relax and learn), and the batch's rows probe out of phase, each probe widening the whole
    # batch's round: the price of trying again soon (docs/shape_policy.md, "How soon a row tries again").
    per_round = np.add(ORACLE_COSTS.verify_cost, ORACLE_COSTS.draft_cost)
    assert bad.metrics.width_rounds[0] >= 0.35 * bad.loop_rounds, bad.metrics
    assert np.dot(bad.metrics.width_rounds, per_round) <= 1.3 * bad.loop_rounds, bad.metrics
    good = oracle_auto(1.0)
    assert good.metrics.width_rounds[-1] >= 0.4 * good.loop_rounds, good.metrics  # the widest chain, soon
    assert good.metrics.mean_accepted_length > 3.5
    for out in (bad, good):
        assert out.tokens == penalised_plain()


def test_eagle_stays_in_step_through_rounds_without_speculation():
    """Under a policy that mixes plain and speculative rounds, every first draft of an EAGLE head
    equals the head's prediction from a fresh full pass over the committed tokens and their real
    target features: the gamma-0 rounds kept its cache in step."""
    import jax

    from specdec_jax.drafters import EagleConfig, EagleDrafter
    from specdec_jax.drafters.eagle import head_logits, head_pass, init_eagle

    cfg = H.target().config
    head = EagleConfig(cfg.hidden_size, cfg.vocab_size, 64, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    drafter = EagleDrafter(head, init_eagle(head, jax.random.key(0)))
    # prior 1, forget at once, relax fast: rounds alternate between probes and plain steps
    costs = policy((0.0, 0.3, 0.6, 1.2), verify=(1.0, 1.2, 1.4, 1.8), prior=1.0, learn=1.0, relax=0.5)
    run = engine.prepare(H.target(), H.RAGGED, drafter, policy=costs, max_new_tokens=H.MAX_NEW)
    model, params = H.target().as_target()

    @jax.jit
    def fresh_first_draft(tokens, n):  # the head over tokens[:, :n] (causal: the padding is unseen)
        width = tokens.shape[1]
        positions = jnp.arange(width, dtype=jnp.int32)[None]
        _, hidden, _ = model.apply(params, tokens, model.init_cache(1, width), positions, None, (-1,))
        h, _ = head_pass(head, drafter.params, model, params, tokens[:, 1:], hidden[0, :, :-1],
                         head.layer.init_cache(1, width - 1), positions[:, :-1])
        return jnp.argmax(head_logits(head, drafter.params, model, params, h[0, n - 2]))

    state, plain_rounds, checked = run.state, 0, 0
    while not bool(state.done[: run.num_rows].all()):
        state = engine.draft_step(run.spec, run.params, state)
        num_draft, drafts = np.asarray(state.proposal.num_draft), np.asarray(state.proposal.drafts)
        plain_rounds += int(num_draft.max() == 0)
        for b in np.flatnonzero(num_draft[: run.num_rows]):
            n = int(state.num_tokens[b])
            assert drafts[b, 0] == int(fresh_first_draft(state.tokens[b : b + 1, :run.spec.capacity], n)), (b, n)
            checked += 1
        state = engine.verify_step(run.spec, run.params, state)
    assert plain_rounds >= 3 and checked >= 10, (plain_rounds, checked)


def test_calibration_is_cached_per_shape_and_refreshed_on_demand(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []

    def fake(target, drafter, batch, capacity, gammas, tree=False):
        calls.append((batch, capacity))
        assert tuple(gammas) == engine.AUTO_GAMMAS == (0, 1, 2, 3, 4)
        return {"T1": 0.01, "verify_s": [0.01, 0.012, 0.014, 0.016, 0.02],
                "draft_s": [0.0, 0.001, 0.002, 0.003, 0.004], "gammas": list(gammas)}

    monkeypatch.setattr(calibration, "measure_costs", fake)
    first = calibration.shape_policy(H.target(), H.ngram(), 4, 128)
    again = calibration.shape_policy(H.target(), H.ngram(), 4, 128)
    assert calls == [(4, 128)] and first == again
    assert first.verify_cost == pytest.approx((1.0, 1.2, 1.4, 1.6, 2.0)) and first.draft_cost[-1] == pytest.approx(0.4)
    calibration.shape_policy(H.target(), H.ngram(), 8, 128)  # another batch: measured apart
    calibration.shape_policy(H.target(), H.ngram(), 4, 192)  # another capacity (a pass reads all of it): apart
    calibration.shape_policy(H.target(), H.ngram(), 4, 128, refresh=True)
    assert calls == [(4, 128), (8, 128), (4, 192), (4, 128)]
    saved = [json.loads(p.read_text()) for p in (tmp_path / "calibration").glob("*.json")]
    assert len(saved) == 3 and all('"batch": ' in s["key"] for s in saved)


# The Qwen2.5-Coder pair's least-time calibration on the project's CPU (32,768-id draft head, KV capacity 256)
PAIR_VERIFY, PAIR_DRAFT = (1.0, 1.128, 1.101, 1.054, 1.163), (0.0, 0.319, 0.594, 0.917, 1.162)


def test_a_draft_models_chains_start_from_its_typical_acceptance(tmp_path, monkeypatch):
    """A draft model names the acceptance its chains typically reach; a policy calibrated for it
    starts there instead of at CHAIN_PRIOR, and so opens with the chain the closed form prefers at
    that acceptance (3 drafts at 0.75 under the pair's costs, 1 at 0.5). The oracle, whose acceptance
    is its parameter, names none; a prior passed explicitly wins."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "measure_costs", lambda *a, **k: {
        "T1": 1.0, "verify_s": list(PAIR_VERIFY), "draft_s": list(PAIR_DRAFT), "gammas": list(engine.AUTO_GAMMAS)})
    live, room = jnp.array([True]), jnp.array([100])

    def opening(p: ShapePolicy) -> int:
        return p.gammas[int(shape.choose_draft(p, p.initial(1), live, room))]

    def closed_form(a: float) -> int:
        rate = [theory.expected_tokens_per_round(a, g) / (v + d) for g, v, d in zip(engine.AUTO_GAMMAS, PAIR_VERIFY,
                                                                                     PAIR_DRAFT)]
        return engine.AUTO_GAMMAS[int(np.argmax(rate))]

    drafting = calibration.shape_policy(H.target(), H.model_drafter(), 1, 64)
    assert drafting.prior == CHAIN_ACCEPTANCE and opening(drafting) == closed_form(CHAIN_ACCEPTANCE) == 3
    oracle = calibration.shape_policy(H.target(), H.oracle(0.5), 1, 64)
    assert oracle.prior == shape.CHAIN_PRIOR and opening(oracle) == closed_form(shape.CHAIN_PRIOR) == 1
    assert calibration.shape_policy(H.target(), H.model_drafter(), 1, 64, prior=0.5).prior == 0.5
    with pytest.raises(ValueError, match="drafter_prior"):
        ShapePolicy(GAMMAS, CPU_COSTS, (0.0,) * 4, drafter_prior=1.5)


def test_a_cheaper_wider_shape_is_kept_and_preferred():
    """Measured here: at batch 4 a round verifying 2 drafts costs less than one verifying 1. The
    policy keeps the costs as measured (never under a plain round) and so never verifies 1 draft
    where it could verify 2 for less."""
    costs = {"T1": 0.1, "verify_s": [0.1, 0.137, 0.125, 0.146], "draft_s": [0.0, 0.001, 0.001, 0.001],
             "gammas": [0, 1, 2, 4]}
    p = calibration.policy_from_costs(costs)
    assert p.verify_cost == pytest.approx((1.0, 1.37, 1.25, 1.46)) and p.free_drafts
    live = jnp.array([True])
    for a1 in (0.4, 0.6, 0.9):  # E(1) = E(2) = 1 + a1 when the second draft is hopeless
        acceptance = jnp.array([[a1, 0.0, 0.0, 0.0]])
        assert int(shape.choose_verify(p, acceptance, live, jnp.array([4]), jnp.array(3))) == 2, a1
    below = calibration.policy_from_costs({**costs, "verify_s": [0.1, 0.09, 0.125, 0.146]})
    assert below.verify_cost[1] == 1.0  # a round's rest never under a plain round


def test_measured_costs_have_one_entry_per_shape():
    costs = calibration.measure_costs(H.target(), H.ngram(), 2, 64, (0, 1, 2))
    assert costs["gammas"] == [0, 1, 2] and len(costs["verify_s"]) == len(costs["draft_s"]) == 3
    assert costs["T1"] == costs["verify_s"][0] and min(costs["verify_s"]) > 0 and min(costs["draft_s"]) >= 0
    assert len(costs["rounds"]) == 3 and min(costs["rounds"].values()) > 0


@pytest.mark.parametrize("seconds, want_repeats", [(0.1, 7), (10.0, 5), (30.0, 3)])
def test_timings_are_least_of_turns_cut_short_by_the_budget(seconds, want_repeats):
    """Three calls timed in turn, the second ``seconds`` long, the others 0.1 s, every call's 2nd and 5th
    sample twice as long: 7 repeats while they fit in BUDGET_S (60 s); else no repeat starts once 60 s
    are spent (10 s: 10.2, 20.4, 10.2, 10.2, 20.4 s a repeat, 71.4 s after 5), but at least 3 run; each
    shape's least time. A count the caller gives is run whole."""
    assert (calibration.REPEATS, calibration.MIN_REPEATS, calibration.BUDGET_S) == (7, 3, 60.0)
    counts = [0, 0, 0]

    def call(i):
        def timed():
            counts[i] += 1
            return [0.1, seconds, 0.1][i] * (1.0 + (counts[i] % 3 == 2))  # the 2nd and 5th twice as long
        return timed

    least = calibration.least_in_turn([call(0), call(1), call(2)])
    assert counts == [want_repeats] * 3
    assert least == pytest.approx([0.1, seconds, 0.1])
    counts[:] = [0, 0, 0]
    calibration.least_in_turn([call(0), call(1), call(2)], repeats=7)  # a count given is kept, whatever it costs
    assert counts == [7] * 3


@pytest.mark.parametrize("kind", ["chain", "free", "tree"])
def test_costs_split_whole_rounds_into_drafting_and_the_rest(kind, monkeypatch):
    """verify_s[i] = R(d_i, i) - draft_s[d_i], with the rounds a program of that kind runs: a chain
    drafts what it verifies, a free drafter always drafts G, a tree (12 nodes) is drafted whole;
    drafting is timed less the overhead of a step that drafts nothing."""
    gammas = (0, 1, 2, 12) if kind == "tree" else (0, 1, 2, 4)
    draft = {"chain": [0.0, 0.2, 0.3, 0.5], "free": [0.0, 0.001, 0.001, 0.001], "tree": [0.0, 0.4, 0.4, 0.4]}[kind]
    timed = []

    def rounds(run, pairs, repeats=7, rounds=1):  # R(d, v) = 1 + drafting gammas[d] + 0.1 v seconds
        timed.append(list(pairs))
        return [1.0 + draft[d] + 0.1 * v for d, v in pairs]

    monkeypatch.setattr(calibration, "time_rounds", rounds)
    # every timed draft step also pays 0.05 s of call overhead, which a step drafting nothing shows
    monkeypatch.setattr(calibration, "time_draft_steps", lambda run, gs: [0.05 + draft[gammas.index(g)] for g in gs])
    monkeypatch.setattr(calibration, "time_target_pass", lambda run, width: 1.0)
    drafter = H.ngram_trie() if kind == "tree" else H.ngram()
    costs = calibration.measure_costs(H.target(), drafter, 2, 64, gammas, tree=kind == "tree")
    want_pairs = {"chain": [(0, 0), (1, 1), (2, 2), (3, 3)], "free": [(3, 0), (3, 1), (3, 2), (3, 3)],
                  "tree": [(0, 0), (3, 1), (3, 2), (3, 3)]}[kind]
    assert timed == [want_pairs]
    assert costs["draft_s"] == pytest.approx(draft)
    assert costs["verify_s"] == pytest.approx([1.0, 1.1, 1.2, 1.3]) and costs["T1"] == costs["verify_s"][0]
    assert set(costs["rounds"]) == {f"{d},{v}" for d, v in want_pairs}
    assert calibration.policy_from_costs(costs, tree=kind == "tree").free_drafts == (kind == "free")


@pytest.mark.parametrize("name", ["ngram", "model", "trie"])
def test_forced_shapes_verify_that_many_drafts_and_stay_lossless(name):
    """`DecodeState.forced_shape`, what the calibration times: every live row verifies exactly the
    forced count (a chain's capped by its room; a tree's nodes are cut by depth in `accept`),
    drafts the drafter did not find being padding, and the output is still plain decoding's."""
    if name == "trie":
        drafter, forced = H.ngram_trie(), tree_policy(tree_sizes=(0, 1, 2, 4, 12))
        shapes = [(4, 4), (4, 2), (0, 0)]
    else:
        drafter = H.ngram() if name == "ngram" else H.model_drafter()
        forced, shapes = policy((0.0, 0.3, 0.6, 1.2)), [(3, 2), (3, 3), (1, 1), (0, 0)]
    for d, v in shapes:
        run = engine.prepare(H.target(), H.RAGGED, drafter, policy=forced, max_new_tokens=H.MAX_NEW)
        state = run.state.replace(forced_shape=jnp.array([d, v], jnp.int32))
        while not bool(state.done[: run.num_rows].all()):
            room = np.asarray(engine.draft_room(run.spec, state))
            state = engine.draft_step(run.spec, run.params, state)
            width = forced.gammas[v]
            want = np.where(room > 0, width, 0) if forced.tree else np.minimum(room, width)
            np.testing.assert_array_equal(np.asarray(state.proposal.num_draft), want)
            state = engine.verify_step(run.spec, run.params, state)
        out = [np.asarray(state.tokens[b, n0:n]).tolist() for b, (n0, n) in
               enumerate(zip(run.prompt_lens[: run.num_rows], np.asarray(state.num_tokens)))]
        assert out == H.reference_no_eos().tokens, (d, v)


TREE_SIZES = (0, 1, 2, 4, 7)


def tree_policy(draft=(0.0,) * 5, verify=(1.0, 1.09, 1.3, 1.3, 1.34), tree_sizes=TREE_SIZES, **estimator) -> ShapePolicy:
    return ShapePolicy(tree_sizes, verify, draft, tree=True, **estimator)


def test_tree_sizes_are_node_counts_up_to_the_tree():
    assert engine.tree_sizes(16) == (0, 1, 2, 4, 8, 16)
    assert engine.tree_sizes(12) == (0, 1, 2, 4, 8, 12)
    assert engine.tree_sizes(3) == (0, 1, 2, 3)
    assert engine.auto_shapes(H.ngram()) == (engine.AUTO_GAMMAS, False)
    assert engine.auto_shapes(H.ngram_trie()) == ((0, 1, 2, 4, 8, 12), True)


def test_a_drafter_with_a_bound_on_its_drafts_is_offered_chains_up_to_it():
    """A DFlash block of B tokens holds B - 1 drafts from one pass: auto chooses among the usual lengths, the
    powers of two and B - 1, none above it; a fixed gamma above it is refused, and the KV capacity of a run
    is sized for the widest of them."""
    assert shape.chain_gammas(3) == (0, 1, 2, 3)
    assert shape.chain_gammas(7) == (0, 1, 2, 3, 4, 7)
    assert shape.chain_gammas(15) == (0, 1, 2, 3, 4, 8, 15)
    assert shape.chain_gammas(None) == engine.AUTO_GAMMAS
    bounded = type("Bounded", (), {"name": "block", "tree": None, "max_drafts": 7})()
    assert engine.auto_shapes(bounded) == ((0, 1, 2, 3, 4, 7), False)
    assert engine.widest_gamma(bounded, engine.AUTO) == engine.widest_gamma(bounded, None) == 7
    assert engine.widest_gamma(bounded, 5) == 5 and engine.widest_gamma(None, engine.AUTO) == 0
    with pytest.raises(ValueError, match="proposes at most 7 drafts a round; gamma = 8"):
        engine.widest_gamma(bounded, 8)
    with pytest.raises(ValueError, match="proposes at most 7 drafts a round; gamma = 8"):  # a policy's widest shape
        resolve_gamma(bounded, None, ShapePolicy((0, 8), (1.0, 2.0), (0.0, 0.1)))


def test_tree_expected_tokens_sum_the_node_marginals_and_the_choice_follows_them():
    p = jnp.array([[0.9, 0.5, 0.3, 0.2, 0.1, 0.1, 0.1]])
    got = np.asarray(shape.expected_tokens(p, jnp.array([7]), TREE_SIZES, tree=True))
    np.testing.assert_allclose(got[0], [1.0, 1.9, 2.4, 2.9, 3.2], rtol=1e-6)
    live, drafted = jnp.array([True]), jnp.array(4)
    # per T1: 1, 1.743, 1.846, 2.231, 2.388: the whole tree ...
    assert int(shape.choose_verify(tree_policy(), p, live, jnp.array([7]), drafted)) == 4
    # ... unless its last nodes cost more than they bring (Tv(8) = 1.6: 2.0 < 2.231): four nodes
    verify = (1.0, 1.09, 1.3, 1.3, 1.6)
    assert int(shape.choose_verify(tree_policy(verify=verify), p, live, jnp.array([7]), drafted)) == 3
    # a tree is grown whole or not at all: never 1, 2 or 4 nodes drafted
    costly = tree_policy(draft=(0.0, 0.5, 0.5, 0.5, 0.5))
    assert int(shape.choose_draft(costly, p, live, jnp.array([7]))) == 4
    assert int(shape.choose_draft(costly, jnp.full((1, 7), 0.05), live, jnp.array([7]))) == 0
    assert shape.draft_options(costly) == (0, 7) and shape.draft_options(policy()) == GAMMAS


def test_tree_estimates_learn_which_verified_nodes_were_on_the_path():
    p = tree_policy(prior=0.5, learn=0.5, relax=0.1, follow=0.2)
    a = jnp.full((2, 7), 0.4)
    path = jnp.array([[1, 3, -1, -1, -1, -1, -1], [-1] * 7])  # row 0 accepted nodes 1 then 3 of the 4 verified
    new = np.asarray(shape.update(p, a, jnp.array([True, True]), jnp.array([4, 0]), jnp.array([2, 0]), path))
    np.testing.assert_allclose(new[0, :4], [0.2, 0.7, 0.2, 0.7], rtol=1e-6)
    # unverified nodes drift toward the node before them (node 4 toward 0.7, the rest toward 0.4)
    np.testing.assert_allclose(new[0, 4:], [0.4 + 0.2 * 0.3, 0.4, 0.4], rtol=1e-6)
    # a row that verified nothing: node 1 relaxes toward the prior
    np.testing.assert_allclose(new[1], [0.4 + 0.1 * 0.1] + [0.4] * 6, rtol=1e-6)
    # before any round: a chain's marginals prior^i
    np.testing.assert_allclose(np.asarray(p.initial(2))[1], 0.5 ** np.arange(1, 8), rtol=1e-6)


@pytest.mark.parametrize("name", ["trie", "decoy-of-model"])
def test_auto_tree_sizes_are_lossless(name):
    drafter = H.ngram_trie() if name == "trie" else H.decoy_tree(H.model_drafter())
    sizes = engine.tree_sizes(drafter.tree.nodes)
    verify = tuple(1.0 + 0.05 * n for n in sizes)
    draft = (0.0,) * len(sizes) if name == "trie" else (0.0,) + (0.3,) * (len(sizes) - 1)
    out = engine.generate(H.target(), H.RAGGED, drafter, policy=ShapePolicy(sizes, verify, draft, tree=True),
                          max_new_tokens=H.MAX_NEW)
    assert out.tokens == H.reference_no_eos().tokens
    assert sum(out.metrics.width_rounds) == out.loop_rounds
    assert sum(r > 0 for r in out.metrics.width_rounds) >= 3, out.metrics.width_rounds  # the size changed


@pytest.mark.slow
def test_auto_tree_of_the_target_itself_settles_on_its_widest_sizes():
    """The target as its own draft model, a top-2 tree of depth 3 with every candidate kept:
    the greedy path is in the whole tree, and 4 tokens a round come only from the widest sizes
    (the tiny model's flat laws rank some deep nodes below shallow ones), which the policy
    settles on."""
    from specdec_jax.drafters import ModelDrafter
    from specdec_jax.token_tree import TreeShape

    cfg, params = H.target().config, H.target().model.params()
    drafter = ModelDrafter(cfg, params, tree=TreeShape(nodes=10, depth=3, topk=2))
    sizes = engine.tree_sizes(10)
    costs = ShapePolicy(sizes, tuple(1.0 + 0.05 * n for n in sizes), (0.0,) + (0.2,) * (len(sizes) - 1), tree=True)
    out = engine.generate(H.target(), H.RAGGED, drafter, policy=costs, max_new_tokens=H.MAX_NEW)
    assert out.tokens == H.reference_no_eos().tokens
    assert sum(out.metrics.width_rounds[-2:]) >= 0.7 * out.loop_rounds, out.metrics.width_rounds
    assert out.metrics.mean_accepted_length > 3.3, out.metrics

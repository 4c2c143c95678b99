"""Closed form of tokens per round vs simulation through verify_greedy."""

import jax
import numpy as np
import pytest

from specdec_jax.theory import expected_tokens_per_round, simulate_tokens_per_round, tokens_per_round_std


@pytest.mark.parametrize("alpha,gamma,value", [(0.8, 4, 3.3616), (0.6, 4, 2.3056), (0.9, 4, 4.0951), (1.0, 3, 4.0)])
def test_closed_form_values(alpha, gamma, value):
    assert expected_tokens_per_round(alpha, gamma) == pytest.approx(value, abs=1e-4)


def test_closed_form_rejects_bad_input():
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_round(1.5, 2)
    with pytest.raises(ValueError, match="gamma"):
        expected_tokens_per_round(0.5, -1)


@pytest.mark.parametrize("alpha,gamma", [(0.6, 2), (0.8, 4), (0.9, 6)])
def test_simulation_within_three_sigma(alpha, gamma):
    rows = 20_000
    n_emit = np.asarray(simulate_tokens_per_round(jax.random.key(7), alpha, gamma=gamma, rows=rows))
    sigma = tokens_per_round_std(alpha, gamma) / np.sqrt(rows)
    assert abs(n_emit.mean() - expected_tokens_per_round(alpha, gamma)) < 3 * sigma
    assert n_emit.min() >= 1 and n_emit.max() <= gamma + 1

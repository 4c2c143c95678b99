"""Checks that run only on an accelerator (skipped on CPU by conftest): the engine on the device.

Run them with `bash scripts/accelerator_check.sh` on a GPU or TPU machine.
"""

import jax
import pytest

from specdec_jax.drafters import NgramDrafter
from specdec_jax.engine import generate
from specdec_jax.models import load_model
from specdec_jax.sampling import SamplingParams

PLATFORMS = [pytest.param("gpu", marks=pytest.mark.gpu), pytest.param("tpu", marks=pytest.mark.tpu)]
PROMPTS = [[104, 101, 108, 108, 111, 32] * 3, [97, 98, 99], list(range(40, 70))]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_generation_runs_on_the_accelerator_and_is_lossless(platform):
    target = load_model("tiny-random")
    assert jax.devices()[0].platform != "cpu"
    with jax.default_matmul_precision("highest"):  # fp32 dots: GPU/TPU default to lower precision
        plain = generate(target, PROMPTS, max_new_tokens=32)
        spec = generate(target, PROMPTS, NgramDrafter(), gamma=4, max_new_tokens=32)
    assert spec.tokens == plain.tokens
    assert spec.metrics.emitted_tokens == plain.metrics.emitted_tokens == 3 * 32


@pytest.mark.parametrize("platform", PLATFORMS)
def test_sampled_rows_are_independent_of_batch_neighbours_on_the_accelerator(platform):
    target = load_model("tiny-random")
    sampling = SamplingParams(temperature=0.8)
    with jax.default_matmul_precision("highest"):
        batch = generate(target, PROMPTS, NgramDrafter(), gamma=3, sampling=sampling, max_new_tokens=16, seed=3)
        solo = generate(target, PROMPTS[1:2], NgramDrafter(), gamma=3, sampling=sampling, max_new_tokens=16, seed=3,
                        row_ids=[1])
    assert solo.tokens[0] == batch.tokens[1]

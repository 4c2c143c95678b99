"""Each decoder family against transformers, through this project's loader (fixture from
scripts/make_hf_family_reference.py; no torch here).

The fixture holds, per family (llama, mistral, qwen2, qwen3), the config dict transformers built the
model from and its logits (float64, eager attention) at every position of two 12-token sequences.
The weights are not stored: `hf_family_weights.state_dict` regenerates them from their seed, and a
checksum recorded by the script proves they are the ones transformers ran. They go through
`hf_config` + `hf_arrays` + `Llama.from_arrays` and one `forward` pass from an empty cache; the
logits must agree within `TOLERANCE`. The power checks show that the fixture sees each family's
difference: without Qwen2's biases, Qwen3's q/k norms (or with them set to ones), or with the
wrong RoPE base, the logits move by far more than the tolerance.

RoPE scaling (fixture hf_rope.json, same script): Llamas with llama3, linear and yarn scaling, tied
and untied, whose original contexts are short enough that every band of each rule lies inside the
head. Our greedy decoding through the cache gives transformers' tokens (every step's top-2 margin is
100x the tolerance) and its last-position logits of the prompt and of the last step within
`TOLERANCE`; the power checks show the scaling, and each option of it, moves the logits.
"""

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_family_weights as fw
from specdec_jax.models import Llama
from specdec_jax.models.llama import forward
from specdec_jax.models.loading import hf_arrays, hf_config
from specdec_jax.models.rope import hf_rope_type, yarn_attention_factor

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
FIXTURE = json.loads((FIXTURES / "hf_families.json").read_text())
LOGITS = {name: np.asarray(f["logits"], np.float32) for name, f in FIXTURE["families"].items()}  # [2, 12, V]
TOKENS = np.asarray(FIXTURE["tokens"], np.int32)  # [2, 12]
FAMILIES = list(FIXTURE["families"])
TOLERANCE = 1e-4  # absolute, on float32 logits of std ~2
POWER = 100 * TOLERANCE  # what a missing family feature must move the logits by, at least


@pytest.fixture(scope="module", autouse=True)
def full_precision_matmuls():
    """The 1e-4 tolerance assumes true fp32 dots (GPUs/TPUs default to TF32/bf16 passes)."""
    with jax.default_matmul_precision("highest"):
        yield


def hub_form(config: dict, rope_scaling: dict | None = None) -> dict:
    """``config`` with its RoPE base as a top-level ``rope_theta`` and ``rope_scaling`` (when given), the
    form of config.json files written before transformers 5 (which nests both in ``rope_parameters``)."""
    out = {k: v for k, v in config.items() if k != "rope_parameters"}
    out["rope_theta"] = config["rope_parameters"]["rope_theta"]
    if rope_scaling is not None:
        out["rope_scaling"] = rope_scaling
    return out


@functools.cache
def jitted_forward(cfg):
    return jax.jit(functools.partial(forward, cfg))


def our_logits(cfg, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """``f32[2, 12, V]`` logits of ``TOKENS`` in one pass from an empty cache."""
    params = Llama.from_arrays(cfg, arrays).params()
    logits, _ = jitted_forward(cfg)(params, jnp.asarray(TOKENS), cfg.init_cache(*TOKENS.shape))
    return np.asarray(logits, np.float32)


@functools.cache
def loaded(family: str, form: str = "hub"):
    """(our config, our arrays) of the family's recorded config dict (``form`` "hub": `hub_form`;
    "recorded": as transformers wrote it) and its regenerated weights."""
    record = FIXTURE["families"][family]
    config = record["config"] if form == "recorded" else hub_form(record["config"])
    weights = fw.state_dict(record["config"])
    assert fw.checksum(weights) == record["weights_sha256"], (
        f"{family}: the regenerated weights are not the ones transformers ran (tests/hf_family_weights.py "
        "or numpy's stream changed): run scripts/make_hf_family_reference.py again")
    cfg = hf_config(config, f"fixture {family}")
    return cfg, hf_arrays(cfg, weights)


def max_diff(family: str, logits: np.ndarray) -> float:
    return float(np.abs(logits - LOGITS[family]).max())


def test_fixture_covers_the_families_and_their_differences():
    assert FAMILIES == ["llama", "mistral", "qwen2", "qwen3"]
    configs = {f: FIXTURE["families"][f]["config"] for f in FAMILIES}
    assert {f: c["tie_word_embeddings"] for f, c in configs.items()} == {
        "llama": False, "mistral": False, "qwen2": True, "qwen3": True}
    assert configs["qwen3"]["head_dim"] * configs["qwen3"]["num_attention_heads"] != configs["qwen3"]["hidden_size"]
    assert {f: c["rope_parameters"]["rope_theta"] for f, c in configs.items()} == {
        "llama": 1e4, "mistral": 1e6, "qwen2": 1e6, "qwen3": 1e6}
    for family in FAMILIES:
        assert LOGITS[family].shape == TOKENS.shape + (configs[family]["vocab_size"],)
    weights = {f: fw.state_dict(c) for f, c in configs.items()}
    assert any(".q_proj.bias" in name for name in weights["qwen2"])
    assert any(".q_norm.weight" in name for name in weights["qwen3"])
    assert not any(name.endswith(".bias") or "_norm.weight" in name and "self_attn" in name
                   for f in ("llama", "mistral") for name in weights[f])
    assert ("lm_head.weight" in weights["llama"]) and ("lm_head.weight" not in weights["qwen2"])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_logits_match_transformers(family):
    cfg, arrays = loaded(family)
    assert cfg.attention_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    diff = max_diff(family, our_logits(cfg, arrays))
    print(f"{family}: max |logits - transformers| = {diff:.2e}")
    assert diff < TOLERANCE


@pytest.mark.parametrize("family", [
    "llama", "mistral", "qwen2", "qwen3"])
def test_logits_match_transformers_from_its_own_config_dict(family):
    """The config dict exactly as transformers 5 writes it: the RoPE base only inside
    ``rope_parameters`` (read wrongly, the base would fall back to 10000: mistral, qwen2 and qwen3
    use 1e6 and would be off by 1.8 to 3.2)."""
    cfg, arrays = loaded(family, "recorded")
    assert max_diff(family, our_logits(cfg, arrays)) < TOLERANCE


def test_qwen2_without_its_biases_is_far_off():
    cfg, arrays = loaded("qwen2")
    zeroed = dict(arrays, **{name: np.zeros_like(arrays[name]) for name in ("bq", "bk", "bv")})
    assert max_diff("qwen2", our_logits(cfg, zeroed)) > POWER
    for name in ("bq", "bk", "bv"):  # each bias matters on its own
        assert max_diff("qwen2", our_logits(cfg, dict(arrays, **{name: np.zeros_like(arrays[name])}))) > POWER


def test_qwen3_without_its_qk_norms_is_far_off():
    cfg, arrays = loaded("qwen3")
    plain = {k: v for k, v in arrays.items() if k not in ("q_norm", "k_norm")}
    assert max_diff("qwen3", our_logits(dataclasses.replace(cfg, qk_norm=False), plain)) > POWER
    for name in ("q_norm", "k_norm"):  # the norms' weights matter, not only the normalisation
        assert max_diff("qwen3", our_logits(cfg, dict(arrays, **{name: np.ones_like(arrays[name])}))) > POWER


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_the_rope_base_is_seen(family):
    cfg, arrays = loaded(family)
    assert max_diff(family, our_logits(dataclasses.replace(cfg, rope_theta=1e4), arrays)) > POWER


# ---------------------------------------------------------------- RoPE scaling

ROPE = json.loads((FIXTURES / "hf_rope.json").read_text())
ROPE_NAMES = list(ROPE["variants"])
PROMPTS = np.asarray(ROPE["prompts"], np.int32)  # [2, 16]


@functools.cache
def rope_loaded(name: str, form: str = "hub"):
    """(our config, our arrays) of a RoPE variant (``form`` as in `loaded`)."""
    record = ROPE["variants"][name]
    config = record["config"] if form == "recorded" else hub_form(record["config"], record["rope_scaling"])
    weights = fw.state_dict(record["config"])
    assert fw.checksum(weights) == record["weights_sha256"], f"{name}: run scripts/make_hf_family_reference.py rope"
    cfg = hf_config(config, f"fixture {name}")
    return cfg, hf_arrays(cfg, weights)


def our_greedy(cfg, arrays, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens i32[2, steps], logits f32[2, V] of the prompt's last position, of the last step)``:
    greedy decoding of `PROMPTS`, the prompt in one pass, then one token per pass through the cache."""
    params = Llama.from_arrays(cfg, arrays).params()
    cache = cfg.init_cache(PROMPTS.shape[0], PROMPTS.shape[1] + steps)
    logits, cache = jitted_forward(cfg)(params, jnp.asarray(PROMPTS), cache)
    cache = cache.with_lengths(cache.lengths + PROMPTS.shape[1])  # a pass writes; the caller commits
    first = step = np.asarray(logits[:, -1], np.float32)
    tokens = []
    for index in range(steps):
        tokens.append(step.argmax(-1).astype(np.int32))
        if index + 1 < steps:  # the logits that choose the next token
            logits, cache = jitted_forward(cfg)(params, jnp.asarray(tokens[-1])[:, None], cache)
            cache = cache.with_lengths(cache.lengths + 1)
            step = np.asarray(logits[:, -1], np.float32)
    return np.stack(tokens, axis=1), first, step


def rope_diff(name: str, cfg, arrays) -> float:
    """Max |logit - transformers'| of one pass over the prompt and the recorded greedy tokens, at the
    prompt's last position and at the last step's."""
    record = ROPE["variants"][name]
    sequence = np.concatenate([PROMPTS, np.asarray(record["greedy"], np.int32)[:, :-1]], axis=1)
    params = Llama.from_arrays(cfg, arrays).params()
    logits, _ = jitted_forward(cfg)(params, jnp.asarray(sequence), cfg.init_cache(*sequence.shape))
    logits = np.asarray(logits, np.float32)
    return float(max(np.abs(logits[:, PROMPTS.shape[1] - 1] - record["first_logits"]).max(),
                     np.abs(logits[:, -1] - record["last_logits"]).max()))


def test_rope_fixture_covers_the_types_tied_and_untied():
    assert ROPE_NAMES == list(fw.ROPE_VARIANTS)
    kinds = {}
    for name in ROPE_NAMES:
        record = ROPE["variants"][name]
        assert record["rope_scaling"] == fw.ROPE_VARIANTS[name]["rope_scaling"]
        assert record["config"]["rope_parameters"]["rope_type"] == hf_rope_type(record["rope_scaling"])
        kinds.setdefault(hf_rope_type(record["rope_scaling"]), set()).add(record["config"]["tie_word_embeddings"])
        assert np.asarray(record["greedy_margins"]).min() > POWER  # no near-tie: the tokens must match exactly
    assert kinds == {"llama3": {False, True}, "linear": {False}, "yarn": {False, True}}
    assert {"type", "rope_type"} <= {key for name in ROPE_NAMES for key in ROPE["variants"][name]["rope_scaling"]}


@pytest.mark.parametrize("name", ROPE_NAMES)
def test_rope_scaling_matches_transformers(name):
    cfg, arrays = rope_loaded(name)
    assert cfg.rope_scaling.rope_type == hf_rope_type(ROPE["variants"][name]["rope_scaling"])
    assert rope_loaded(name, "recorded")[0] == cfg  # transformers 5's rope_parameters give the same config
    tokens, first, last = our_greedy(cfg, arrays, ROPE["new_tokens"])
    record = ROPE["variants"][name]
    diff = max(np.abs(first - record["first_logits"]).max(), np.abs(last - record["last_logits"]).max())
    print(f"{name}: max |logits - transformers| = {diff:.2e} (greedy, through the cache)")
    assert diff < TOLERANCE
    np.testing.assert_array_equal(tokens, record["greedy"])
    assert rope_diff(name, cfg, arrays) < TOLERANCE  # one pass over the whole sequence too


POWER_CHECKS = {  # variant -> changes of its RopeScaling (None: no scaling) that must move the logits
    "llama3": [None, dict(high_freq_factor=2.0), dict(low_freq_factor=0.5), dict(original_max_positions=128)],
    "llama3_tied": [None, dict(factor=8.0)],
    "linear": [None, dict(factor=2.0)],
    "yarn_tied": [None, dict(attention_factor=1.0)],
    "yarn_options": [dict(truncate=True), dict(beta_fast=32.0), dict(beta_slow=1.0),
                     dict(attention_factor=yarn_attention_factor(4.0, None, None))],
}


@pytest.mark.parametrize("name", ROPE_NAMES)
def test_rope_scaling_and_each_option_move_the_logits(name):
    cfg, arrays = rope_loaded(name)
    for change in POWER_CHECKS[name]:
        scaling = None if change is None else dataclasses.replace(cfg.rope_scaling, **change)
        assert rope_diff(name, dataclasses.replace(cfg, rope_scaling=scaling), arrays) > POWER, change

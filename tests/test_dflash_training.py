"""DFlash drafters trained here (`train-draft --kind dflash`, `distill.dflash_drafter`): the loss falls, the
saved folder is z-lab's layout (config.json names the target layers, block size and mask token) and loads
through `drafters.published` to a drafter that drafts losslessly, the trained forward is drafting's (each
anchored block's logits equal a drafting pass over the context before its anchor), and bad settings are
one-line errors."""

from __future__ import annotations

import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine
from specdec_jax.distill.dflash_drafter import (anchored_logits, dflash_layers, init_dflash, position_weights,
                                               sample_anchors)
from specdec_jax.distill.kinds import shared_target_weights
from specdec_jax.distill.train import train_draft
from specdec_jax.drafters.dflash import DFlashConfig, DFlashDrafter, block_logits, write_context
from specdec_jax.drafters.published import load_drafter_folder
from specdec_jax.models import LlamaConfig
from specdec_jax.models.llama import LlamaTarget
from specdec_jax.models.loading import read_safetensors
from specdec_jax.target import FINAL_NORM
from test_distill import log_of, tiny_config

SETTINGS = dict(kind="dflash", draft_vocab=0, feature_layers=(0, 2, -1), block_size=4, anchors=4, steps=12)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(config, summary) of one uninterrupted run."""
    root = tmp_path_factory.mktemp("dflash")
    tc = tiny_config(root, **SETTINGS)
    return tc, train_draft(tc, root / "run", progress=False)


@pytest.fixture(scope="module")
def trained(run):
    return run[1]


@pytest.fixture(scope="module", autouse=True)
def full_precision_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def test_training_lowers_the_loss(trained):
    log = log_of(pathlib.Path(trained["out"]))
    assert [r["step"] for r in log] == list(range(1, SETTINGS["steps"] + 1))
    assert trained["finished"] and np.mean([r["loss"] for r in log[-3:]]) < 0.8 * log[0]["loss"]
    assert {"loss", "agreement", "accepted"} <= set(trained["heldout"])


def test_saved_config_names_the_target_layers_block_and_mask(trained):
    folder = pathlib.Path(trained["draft"])
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 4 and config["num_target_layers"] == 4 and config["num_hidden_layers"] == 1
    # our 0, 2 and the final-norm state: z-lab's outputs of layers 0, 2 and L - 1 (final-normed)
    assert config["dflash_config"] == {"mask_token_id": H.target().tokenizer.eos_id, "target_layer_ids": [0, 2, 3]}
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= names
    assert not any("embed" in name or "lm_head" in name for name in names)  # the target's: not saved


def test_trained_drafter_loads_by_path_and_drafts_losslessly(trained, capsys):
    drafter = load_drafter_folder(trained["draft"], "dflash", H.target())
    assert isinstance(drafter, DFlashDrafter)
    assert drafter.config.feature_layers == (0, 2, FINAL_NORM) and drafter.config.block_size == 4
    out = engine.generate(H.target(), H.RAGGED, drafter, gamma=3, max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())
    assert out.tokens == H.reference().tokens
    assert out.metrics.draft_tokens > 0
    H.assert_cli_drafts_as_plain(capsys, "dflash", trained["draft"], 3)


def test_kill_and_resume_gives_the_uninterrupted_drafter(run, tmp_path):
    tc, summary = run
    shutil.copytree(pathlib.Path(summary["out"]) / "data", tmp_path / "run" / "data")  # same data
    first = train_draft(tc, tmp_path / "run", progress=False, stop_after=5)  # as a kill after step 5 would
    assert not first["finished"] and first["steps"] == 5
    second = train_draft(tc, tmp_path / "run", resume=True, progress=False)
    assert second["finished"]
    assert (pathlib.Path(second["draft"]) / "config.json").read_text() == \
        (pathlib.Path(summary["draft"]) / "config.json").read_text()
    a, b = (read_safetensors(pathlib.Path(s["draft"]) / "model.safetensors") for s in (summary, second))
    assert a.keys() == b.keys()
    for name in a:  # the anchors of a step are a function of the step: resumed batches are the same blocks
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_each_anchored_block_is_a_drafting_pass_over_the_context_before_its_anchor():
    target = H.target()
    layer = LlamaConfig(vocab_size=target.config.vocab_size, hidden_size=target.config.hidden_size, num_layers=2,
                        intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
    cfg = DFlashConfig(layer, (0, FINAL_NORM), target.config.hidden_size, 3, 7)
    params = {**{k: jnp.asarray(v) for k, v in init_dflash(cfg, 5).items()}, "target": shared_target_weights(target)}
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, layer.vocab_size, (2, 10)), jnp.int32)
    features = jnp.asarray(rng.standard_normal((2, 10, 2, layer.hidden_size)), jnp.float32)
    anchors = jnp.asarray([[1, 4, 8], [7, 2, 5]], jnp.int32)
    trained = anchored_logits(cfg, LlamaTarget(target.config), params, tokens, features, anchors)

    @functools.partial(jax.jit, static_argnums=0)  # one program per context length, not one per op
    def served(a, params, anchor_token, context):
        block = jnp.concatenate([anchor_token[None, None], jnp.full((1, 2), 7, jnp.int32)], axis=1)
        cache = write_context(cfg, params, layer.init_cache(1, a), context, jnp.arange(a)[None])
        return block_logits(cfg, params, LlamaTarget(target.config), params["target"], block, a + jnp.arange(3)[None],
                            cache, jnp.ones((1, 3, a), bool), jnp.ones((1, 3, 3), bool))[0]

    for row in range(2):
        for column, a in enumerate(np.asarray(anchors[row]).tolist()):
            want = served(a, params, tokens[row, a], features[row : row + 1, :a])
            np.testing.assert_allclose(trained[row, column], want, atol=1e-4)


def test_anchors_are_distinct_candidates_and_weights_follow_the_reference():
    weight = jnp.asarray([[1.0] * 6 + [0.0] * 4, [1.0] * 10])
    anchors, valid = sample_anchors(weight, 20, 3, jax.random.key(0))
    assert anchors.shape == (2, 8)  # S - B + 1 candidates at most
    for row, count in ((0, 5), (1, 8)):  # 1 <= a <= S - B + 1 with weight[a] > 0
        used = sorted(np.asarray(anchors[row])[np.asarray(valid[row])].tolist())
        assert used == list(range(1, count + 1))
    q, mask = jnp.asarray([[0.5, 1.0, 0.0]]), jnp.asarray([[1.0, 1.0, 0.0]])
    s = 0.75  # (1 - alpha) q + alpha, alpha 0.5, q = 0.5
    np.testing.assert_allclose(position_weights(q, mask, "dpace", 4.0), [[s + s, s, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(position_weights(q, mask, "decay", 2.0), [[1.0, np.exp(-0.5), np.exp(-1.0)]],
                               rtol=1e-6)


def test_default_layers_are_zlab_s_and_bad_settings_are_one_line_errors(tmp_path):
    assert dflash_layers((-1,), 2, 8) == (1, 5)  # z-lab's [1, L - 3] spread
    assert dflash_layers((-1,), 3, 4) == (1,)  # ids [1, 1, 1]: duplicates of a shallow target dropped
    assert dflash_layers((-1,), 1, 2) == (FINAL_NORM,)  # id L // 2 = L - 1: the final-normed state
    with pytest.raises(ValueError, match="no id for the un-normed output"):
        dflash_layers((0, 3), 1, 4)
    bad = [(dict(block_size=1), "block_size must be at least 2"), (dict(block_size=40), "leaves no anchor"),
           (dict(anchors=0), "anchors must be"), (dict(position_weight="flat"), "position_weight must be"),
           (dict(decay_gamma=0.0), "decay_gamma must be"), (dict(mask_token=-2), "mask_token must be"),
           (dict(draft_vocab=64), "draft_vocab must be 0")]
    for change, message in bad:
        with pytest.raises(ValueError, match=message) as err:
            tiny_config(tmp_path, **{**SETTINGS, **change})
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        train_draft(tiny_config(tmp_path, **SETTINGS, mask_token=100000), tmp_path / "run", progress=False)

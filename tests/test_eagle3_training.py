"""EAGLE-3 heads trained here (`train-draft --kind eagle --eagle-version 3`), saved in speculators'
format: the saved config keys, weight names and shapes are those speculators 0.9.0 writes for the
same head (tests/fixtures/speculators_eagle3_format.json, from scripts/make_speculators_eagle3_format.py),
the folder loads through `drafters.published` to the same drafter, and drafts losslessly."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine
from specdec_jax.distill.eagle3_head import eagle3_config, eagle3_layers, init_eagle3
from specdec_jax.distill.train import train_draft
from specdec_jax.drafters.eagle3 import Eagle3Drafter, head_logits, head_pass, project
from specdec_jax.drafters.published import load_drafter_folder
from specdec_jax.drafters.speculators_format import save_eagle3, speculators_config
from specdec_jax.models.llama import LlamaTarget
from test_distill import tiny_config

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "speculators_eagle3_format.json").read_text())
WIDTHS = dict(intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)  # the fixture's head
NOT_WRITTEN = {"auto_map", "transformers_version"}  # speculators' python-class pointer and library version


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    tc = tiny_config(root, kind="eagle", eagle_version=3, feature_layers=(0, 1, 2), draft_vocab=128, ttt_steps=1,
                     ce_weight=1.0, **WIDTHS)
    return train_draft(tc, root / "run", progress=False)


def saved_format(folder: pathlib.Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        weights = {name: [list(f.get_tensor(name).shape), str(f.get_tensor(name).dtype)] for name in f.keys()}
    return config, weights


def test_the_published_default_layers_are_the_inputs_of_2_half_and_l_minus_3():
    assert eagle3_layers((-1,), 32) == (1, 15, 28)
    assert eagle3_layers((-1,), 4) == (1, 0)  # ids [2, 2, 1]: duplicates of a shallow target dropped
    assert eagle3_layers((0, 2), 4) == (0, 2)


def test_an_eagle3_head_refuses_the_final_norm_state_among_its_layers(tmp_path):
    with pytest.raises(ValueError, match="cannot hold -1"):
        tiny_config(tmp_path, kind="eagle", feature_layers=(1, -1))
    assert tiny_config(tmp_path, kind="eagle", eagle_version=1, feature_layers=(1, -1)).eagle_version == 1
    assert tiny_config(tmp_path, kind="eagle").eagle_version == 3  # EAGLE-3 unless asked otherwise


def test_trained_head_is_saved_as_speculators_writes_it(trained):
    config, weights = saved_format(pathlib.Path(trained["draft"]))
    reference = FIXTURE["reduced"]
    assert weights == reference["weights"]
    assert sorted(config) == sorted(set(reference["config_keys"]) - NOT_WRITTEN)
    assert sorted(config["transformer_layer_config"]) == reference["layer_config_keys"]
    assert sorted(config["speculators_config"]) == reference["speculators_config_keys"]
    for key in ("speculators_model_type", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "architectures"):
        assert config[key] == reference["config"][key], key
    layer, expected = config["transformer_layer_config"], reference["config"]["transformer_layer_config"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "rope_parameters", "num_hidden_layers", "model_type"):
        assert layer[key] == expected[key], key


@pytest.mark.parametrize("draft_vocab", [128, 0])
def test_the_saved_folder_loads_back_to_the_same_drafter(draft_vocab, tmp_path):
    target = H.target()
    cfg = target.config
    head = eagle3_config(cfg, (0, 1, 3), WIDTHS, draft_vocab or None)
    vocab_map = np.random.default_rng(1).permutation(cfg.vocab_size)[:draft_vocab] if draft_vocab else None
    arrays = init_eagle3(head, 3, target.model.arrays()["lm_head"].T, vocab_map)
    embed = target.model.arrays()["embed"]
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "specdec_head.json").write_text("{}")  # an earlier head in the folder: replaced
    folder = save_eagle3(tmp_path / "head", head, arrays, embed, speculators_config(head, cfg.num_layers, "tiny-random",
                                                                                      ["LlamaForCausalLM"], 3))
    if not draft_vocab:
        assert saved_format(folder)[1] == FIXTURE["full"]["weights"]
    loaded = load_drafter_folder(folder, "eagle", target)
    unlimited = dataclasses.replace(loaded.config.layer, max_positions=None)  # written as 2048 when unset
    assert isinstance(loaded, Eagle3Drafter) and dataclasses.replace(loaded.config, layer=unlimited) == head
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 5)), jnp.int32)
    features = jnp.asarray(rng.standard_normal((1, 5, 3, cfg.hidden_size)), jnp.float32)
    logits = []
    for params in (arrays, loaded.params):
        params = {**params, "target": {"embed": embed}}
        h, _ = head_pass(head, params, LlamaTarget(cfg), params["target"], tokens, project(head, params, features),
                         head.layer.init_cache(1, 8), jnp.arange(5)[None])
        logits.append(np.asarray(head_logits(head, params, h)[0]))
    np.testing.assert_array_equal(logits[0], logits[1])


def test_trained_head_loads_by_path_and_drafts_losslessly(trained, capsys):
    drafter = load_drafter_folder(trained["draft"], "eagle", H.target())
    assert isinstance(drafter, Eagle3Drafter)
    out = engine.generate(H.target(), H.RAGGED, drafter, gamma=3, max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())
    assert out.tokens == H.reference().tokens
    assert out.metrics.draft_tokens > 0
    assert {"agreement_step2"} <= set(trained["heldout"])
    H.assert_cli_drafts_as_plain(capsys, "eagle", trained["draft"], 2)

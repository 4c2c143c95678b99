"""EAGLE and Medusa heads on tiny-random: training lowers each loss, resume is exact, the split
holds, a trained head loads by path and drafts losslessly, and mismatched heads are clear errors.

The runs share the question file and shapes of tests/test_distill.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

import engine_helpers as H
from specdec_jax import engine
from specdec_jax.cli import main
from specdec_jax.distill.train import train_draft
from specdec_jax.drafters import EagleConfig, EagleDrafter, MedusaConfig, MedusaDrafter, load_head
from specdec_jax.drafters.eagle import init_eagle
from specdec_jax.drafters.heads import save_head
from specdec_jax.models import LoadedModel, load_model
from specdec_jax.models.llama import Llama
from specdec_jax.sampling import SamplingParams
from specdec_jax.token_tree import TreeShape
from test_distill import STEPS, log_of, tiny_config

KINDS = {"eagle": dict(kind="eagle", eagle_version=1, feature_layers=(1, -1), ce_weight=1.0),  # this project's head
         "medusa": dict(kind="medusa", medusa_heads=3)}


@functools.cache
def trained(kind: str, root: str):
    folder = f"{root}/{kind}"
    summary = train_draft(tiny_config(root, **KINDS[kind]), folder, progress=False)
    return folder, summary


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("heads"))


@pytest.mark.parametrize("kind", list(KINDS))
def test_training_lowers_the_loss_and_keeps_heldout_ids_out(kind, root):
    folder, summary = trained(kind, root)
    log = log_of(pathlib.Path(folder))
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert summary["finished"] and np.mean([r["loss"] for r in log[-2:]]) < 0.9 * log[0]["loss"], log
    assert 0.0 <= summary["heldout"]["agreement"] <= 1.0
    split = json.loads((pathlib.Path(folder) / "data" / "split.json").read_text())
    assert split["heldout_ids"] == [6, 10] and not set(split["heldout_ids"]) & set(split["train_ids"])
    with np.load(f"{folder}/data/train.npz") as data:  # teacher-forced features of the requested layers
        layers = 2 if kind == "eagle" else 1
        assert data["features"].shape[2:] == (layers, H.target().config.hidden_size)


@pytest.mark.parametrize("kind", list(KINDS))
def test_kill_and_resume_gives_the_uninterrupted_parameters(kind, root, tmp_path):
    folder, summary = trained(kind, root)
    tc = tiny_config(root, **KINDS[kind])
    first = train_draft(tc, tmp_path / "run", progress=False, stop_after=3)
    assert not first["finished"]
    resumed = train_draft(tc, tmp_path / "run", resume=True, progress=False)
    a, b = load_head(summary["draft"]).params, load_head(resumed["draft"]).params
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("kind", ["eagle", pytest.param("medusa", marks=pytest.mark.slow)])
def test_trained_head_loads_by_path_and_drafts_losslessly(kind, root, capsys):
    folder, summary = trained(kind, root)
    drafter = load_head(summary["draft"], kind=kind)
    out = engine.generate(H.target(), H.RAGGED, drafter, gamma=3, max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())
    assert out.tokens == H.reference().tokens
    assert out.metrics.draft_tokens > 0
    sampled = SamplingParams(temperature=0.8, top_p=0.9)  # runs with its real q (law tests: test_engine_law)
    out = engine.generate(H.target(), H.RAGGED, drafter, gamma=3, max_new_tokens=8, sampling=sampled)
    assert all(len(t) == 8 or r == "eos" for t, r in zip(out.tokens, out.stop_reasons))
    code = main(["generate", "--model", "tiny-random", "--raw", "--drafter", kind, "--draft-model",
                 summary["draft"], "--gamma", "2", "--max-new-tokens", "6", "--prompt", "abcabc"])
    assert code == 0 and "tokens/round" in capsys.readouterr().out


@pytest.mark.parametrize("kind", [pytest.param("eagle", marks=pytest.mark.slow), "medusa"])
def test_trained_head_drafts_a_lossless_tree_by_path_and_flags(kind, root, capsys, tmp_path):
    """EAGLE's dynamic tree and Medusa's static tree (a choices file through the CLI)."""
    folder, summary = trained(kind, root)
    drafter = dataclasses.replace(load_head(summary["draft"], kind=kind), tree=TreeShape(nodes=6, depth=3, topk=2))
    out = engine.generate(H.target(), H.RAGGED, drafter, max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())
    assert out.tokens == H.reference().tokens and out.metrics.draft_tokens > 0
    choices = tmp_path / "tree.json"
    choices.write_text(json.dumps([[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
    flags = (["--tree-choices", str(choices)] if kind == "medusa"
             else ["--tree-nodes", "6", "--tree-depth", "3", "--tree-topk", "2"])
    code = main(["generate", "--model", "tiny-random", "--raw", "--drafter", kind, "--draft-model", summary["draft"],
                 *flags, "--max-new-tokens", "6", "--prompt", "abcabc"])
    shape = "tree=5 nodes, depth 3]" if kind == "medusa" else "tree=6 nodes, depth 3, top-2]"
    assert code == 0 and shape in capsys.readouterr().out


def test_mismatched_heads_are_clear_errors(root, tmp_path):
    folder, summary = trained("eagle", root)
    eagle = load_head(summary["draft"])
    narrow = load_model("tiny-random-draft")  # hidden size 64, the head's 128
    with pytest.raises(ValueError, match="the EAGLE head: built for hidden size 128"):
        engine.generate(narrow, [[1, 2, 3]], eagle, gamma=2, max_new_tokens=4)
    cfg = H.target().config
    deep = EagleConfig(cfg.hidden_size, cfg.vocab_size, 64, 4, 2, 32, feature_layers=(7,))
    with pytest.raises(ValueError, match="reads target layers"):
        engine.generate(H.target(), [[1, 2, 3]], EagleDrafter(deep, init_eagle(deep, jax.random.key(0))), gamma=2,
                        max_new_tokens=4)
    with pytest.raises(ValueError, match="medusa head, not a eagle"):
        load_head(trained("medusa", root)[1]["draft"], kind="eagle")
    with pytest.raises(ValueError, match="not a drafter head folder"):
        load_head(tmp_path)
    medusa = MedusaConfig(cfg.hidden_size, cfg.vocab_size, 2)
    with pytest.raises(ValueError, match="gamma 3 exceeds the 2 Medusa heads"):
        engine.generate(H.target(), [[1, 2, 3]], MedusaDrafter(medusa, {"w": np.zeros((2, 128, 128), np.float32),
                                                                        "b": np.zeros((2, 128), np.float32)}),
                        gamma=3, max_new_tokens=4)
    with pytest.raises(ValueError, match="the Medusa heads: built for hidden size 128 and vocabulary 258; the target has 64"):
        engine.generate(narrow, [[1, 2, 3]], MedusaDrafter(medusa, {"w": np.zeros((2, 128, 128), np.float32),
                                                                    "b": np.zeros((2, 128), np.float32)}),
                        gamma=2, max_new_tokens=4)
    bad = dict(eagle.params, vocab_map=np.zeros_like(eagle.params["vocab_map"]))  # repeated ids
    path = save_head(tmp_path / "bad", "eagle", eagle.config, bad, {})
    with pytest.raises(ValueError, match="vocab_map must hold distinct ids"):
        load_head(path)


def test_a_head_is_refused_on_another_target_of_the_same_width(root, tmp_path, capsys):
    """A head records its target's fingerprint (weight shapes, tokenizer): the same width but two layers
    fewer is refused; its own target loads it. A head given to --drafter draft-model names its drafter;
    a tree top-k past the head's output ids names the flag."""
    folder, summary = trained("eagle", root)
    target = load_model("tiny-random")
    assert load_head(summary["draft"], target=target) is not None
    shallow_config = dataclasses.replace(target.config, num_layers=2)
    shallow = LoadedModel(Llama(shallow_config, rngs=nnx.Rngs(1)), shallow_config, target.tokenizer)
    with pytest.raises(ValueError, match=r"was trained on tiny-random \(fingerprint \w+\), not on this target"):
        load_head(summary["draft"], target=shallow)
    code = main(["generate", "--model", "tiny-random", "--raw", "--prompt", "ab", "--max-new-tokens", "4",
                 "--drafter", "draft-model", "--draft-model", summary["draft"]])
    assert code == 2 and "holds a trained eagle head, not a draft model: use --drafter eagle" in capsys.readouterr().err
    code = main(["generate", "--model", "tiny-random", "--raw", "--prompt", "ab", "--max-new-tokens", "4",
                 "--drafter", "eagle", "--draft-model", summary["draft"], "--tree-topk", "200"])
    assert code == 2 and "--tree-topk 200 exceeds the" in capsys.readouterr().err


FAKE_CHATS = {
    "b": {"messages": [[{"text": "hi", "sender": "x"}, {"text": "how are you?", "sender": "x"}],
                       [{"text": "good", "sender": "y"}], [{"text": " ", "sender": "x"}]]},
    "a": {"messages": [[{"text": "only one turn", "sender": "x"}]]},
    "c": {"messages": [[{"text": "q", "sender": "x"}], [{"text": "r", "sender": "y"}], [{"text": "s", "sender": "x"}]]},
}


class TemplateTokenizer:
    """The byte tokenizer with a visible chat template (tiny-random's has none)."""

    def __init__(self):
        from specdec_jax.models.tokenizer import ByteTokenizer

        self._bytes = ByteTokenizer()

    def apply_chat_template(self, messages):
        return "".join(f"[{m['role']}]{m['content']}" for m in messages)

    def __getattr__(self, name):
        return getattr(self._bytes, name)


def test_chitchat_conversations_become_chat_texts(monkeypatch):
    from specdec_jax.distill import chitchat

    monkeypatch.setattr(chitchat, "chitchat_conversations", lambda progress=True: FAKE_CHATS)
    records = chitchat.chitchat_records(TemplateTokenizer(), limit=5)
    # sorted by id; "a" has no reply and is skipped; turns alternate from the first speaker; blank turns dropped
    assert records == [{"id": "chitchat-b", "text": "[user]hi\nhow are you?[assistant]good"},
                       {"id": "chitchat-c", "text": "[user]q[assistant]r[user]s"}]
    assert len(chitchat.chitchat_records(TemplateTokenizer(), limit=1)) == 1


def test_extra_text_adds_teacher_forced_training_windows_only(root, tmp_path, monkeypatch):
    from specdec_jax.distill import chitchat, train

    monkeypatch.setattr(chitchat, "chitchat_conversations", lambda progress=True: FAKE_CHATS)
    monkeypatch.setattr(train, "chitchat_records",
                        lambda tok, limit, progress=True: chitchat.chitchat_records(TemplateTokenizer(), limit))
    tc = tiny_config(root, **KINDS["medusa"], extra_text="chitchat", extra_examples=2, steps=2, warmup_steps=1,
                     save_every=2, eval_every=2)
    train_draft(tc, tmp_path / "run", progress=False)
    plain = np.load(f"{trained('medusa', root)[0]}/data/train.npz")
    with_extra = np.load(tmp_path / "run" / "data" / "train.npz")
    assert len(with_extra["tokens"]) == len(plain["tokens"]) + 2
    held_plain = np.load(f"{trained('medusa', root)[0]}/data/heldout.npz")
    np.testing.assert_array_equal(np.load(tmp_path / "run" / "data" / "heldout.npz")["tokens"], held_plain["tokens"])
    with pytest.raises(ValueError, match="needs kind eagle or medusa"):
        tiny_config(root, extra_text="chitchat", extra_examples=2)


# ---------------------------------------------------------------- EAGLE-3's training-time test (ttt_steps)

def ttt_head(version: str):
    """(head config, params with the target's embedding) of a random EAGLE-1 or EAGLE-3 head of the test target."""
    from specdec_jax.distill.eagle3_head import eagle3_config, init_eagle3

    cfg, arrays = H.target().config, H.target().model.arrays()
    if version == "eagle1":
        head = EagleConfig(cfg.hidden_size, cfg.vocab_size, 64, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        params = init_eagle(head, jax.random.key(3))
    else:
        head = eagle3_config(cfg, (0, 2), dict(intermediate_size=64, num_heads=cfg.num_heads,
                                                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim), None)
        head = dataclasses.replace(head, norm_output=version == "eagle3-norm_output")
        params = init_eagle3(head, 3, arrays["lm_head"].T, None)
    return head, {**params, "target": {"embed": arrays["embed"], "lm_head": arrays["lm_head"]}}


@pytest.mark.parametrize("version", ["eagle1", "eagle3", "eagle3-norm_output"])
def test_training_time_test_steps_are_what_drafting_computes(version):
    """Step t of the unrolled loss at position j equals draft t + 1 of the drafting path: the head's
    cache filled with the real context up to j - t, then what it feeds back (its outputs, or EAGLE-3's
    normed ones) fed t times (the tokens teacher-forced); a wrong visibility (step 0 up to j, or the
    whole of earlier steps) fails."""
    import jax.numpy as jnp

    from specdec_jax.distill.kinds import head_functions, unrolled_outputs
    from specdec_jax.models.llama import LlamaTarget

    cfg = H.target().config
    head, params = ttt_head(version)
    functions, target = head_functions(head), LlamaTarget(cfg)
    rng = np.random.default_rng(0)
    width, steps = 7, 3
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, width)), jnp.int32)
    inputs = jnp.asarray(rng.standard_normal((1, width, cfg.hidden_size)), jnp.float32)
    outputs = unrolled_outputs(head, target, params, tokens, inputs, steps)
    # one compiled pass per input width (op-by-op dispatch would compile every operation per width)
    drafting = jax.jit(functools.partial(functions.head_pass, head, target=target), static_argnames="target")
    feed = jax.jit(lambda params, h: functions.logits(head, params, target, params["target"], h)[1])
    for step in range(1, steps):
        for j in range(step, width):
            start = j - step  # the real context: positions 0 .. start
            h, cache = drafting(params, target_params=params["target"], tokens=tokens[:, : start + 1],
                                inputs=inputs[:, : start + 1], cache=head.layer.init_cache(1, width),
                                positions=jnp.arange(start + 1)[None])
            fed, h = feed(params, h[:, -1]), h[:, -1]
            for position in range(start + 1, j + 1):
                h, cache = drafting(params, target_params=params["target"], tokens=tokens[:, position : position + 1],
                                    inputs=fed[:, None], cache=cache.with_lengths(jnp.asarray([position])),
                                    positions=jnp.asarray([[position]]))
                fed, h = feed(params, h[:, 0]), h[:, 0]
            np.testing.assert_allclose(outputs[step][0, j], h[0], rtol=2e-4, atol=2e-4, err_msg=f"step {step} j {j}")


@pytest.mark.slow
def test_training_time_test_trains_and_reports_later_drafts(root):
    tc = tiny_config(root, kind="eagle", ttt_steps=2, ce_weight=1.0)
    summary = train_draft(tc, f"{root}/eagle-ttt", progress=False)
    log = log_of(pathlib.Path(f"{root}/eagle-ttt"))
    assert summary["finished"] and np.mean([r["loss"] for r in log[-2:]]) < 0.9 * log[0]["loss"], log
    assert {"agreement_step2", "agreement_step3"} <= set(summary["heldout"])
    with pytest.raises(ValueError, match="ttt_steps .* is for kind eagle"):
        tiny_config(root, kind="medusa", ttt_steps=1)

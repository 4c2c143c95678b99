"""`train-draft` on tiny-random: the loss falls, resume is exact, bad checkpoints are clear errors,
the exported draft loads by path and drafts losslessly; engine top-k recording; reduced vocabularies."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engine_helpers as H
from specdec_jax import engine
from specdec_jax.cli import main
from specdec_jax.distill.config import TrainConfig, train_config
from specdec_jax.distill.data import batch_indices, split_questions, vocab_by_frequency
from specdec_jax.distill.draft import copied_layers, distill_loss
from specdec_jax.distill.kinds import kind_of
from specdec_jax.distill.train import learning_rate_schedule, train_draft
from specdec_jax.drafters.eagle3 import Eagle3Config
from specdec_jax.drafters import ModelDrafter
from specdec_jax.models import load_model
from specdec_jax.models.llama import Llama
from specdec_jax.sampling import SamplingParams

QUESTIONS = [  # with 1 held out per category: ids 6 (category a) and 10 (category b)
    {"question_id": 1, "category": "a", "turns": ["the cat sat on the mat", "and then?"]},
    {"question_id": 2, "category": "a", "turns": ["one two three four"]},
    {"question_id": 3, "category": "b", "turns": ["hello world hello"]},
    {"question_id": 4, "category": "b", "turns": ["abc abc abc"]},
    {"question_id": 5, "category": "b", "turns": ["held out prompt"]},
    {"question_id": 6, "category": "a", "turns": ["more text here"]},
    {"question_id": 10, "category": "b", "turns": ["another held out"]},
]
STEPS = 6


@functools.cache
def prompts_file(folder: str) -> str:
    path = pathlib.Path(folder) / "questions.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    return str(path)


def tiny_config(folder, **overrides) -> TrainConfig:
    values = dict(target="tiny-random", prompts_file=prompts_file(str(folder)), gen_max_new_tokens=16,
                  gen_batch_size=8, heldout_per_category=1, eval_prompts=2, teacher_top_k=4, seq_len=32, num_layers=1, draft_vocab=64,
                  steps=STEPS, batch_size=4, learning_rate=3e-3, warmup_steps=1, save_every=3, eval_every=3)
    return TrainConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One uninterrupted run (the reference of the resume test), its folder and config."""
    folder = tmp_path_factory.mktemp("distill")
    tc = tiny_config(folder)
    summary = train_draft(tc, folder / "run", progress=False)
    return tc, folder, summary


def log_of(run: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_training_lowers_the_loss(trained):
    tc, folder, summary = trained
    log = log_of(folder / "run")
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert summary["finished"] and np.mean([r["loss"] for r in log[-2:]]) < 0.8 * log[0]["loss"]
    assert (folder / "run" / "training_curve.png").stat().st_size > 0
    assert 0.0 <= summary["heldout"]["agreement"] <= 1.0


def test_split_by_question_id_never_trains_on_heldout(trained):
    _, folder, _ = trained
    split = json.loads((folder / "run" / "data" / "split.json").read_text())
    assert split["heldout_ids"] == [6, 10] and not set(split["heldout_ids"]) & set(split["train_ids"])
    train, heldout = split_questions(QUESTIONS, 2)
    assert {q["question_id"] for q in heldout} == {2, 6, 5, 10} and len(train) == 3


def test_kill_and_resume_gives_the_uninterrupted_parameters(trained):
    tc, folder, summary = trained
    run = folder / "resumed"
    run.mkdir()
    shutil.copytree(folder / "run" / "data", run / "data")  # same data, skip rebuilding it
    first = train_draft(tc, run, progress=False, stop_after=4)  # stops after step 4, as a kill would
    assert not first["finished"] and first["steps"] == 4
    with pytest.raises(ValueError, match="--resume"):
        train_draft(tc, run, progress=False)
    second = train_draft(tc, run, resume=True, progress=False)
    assert second["finished"]
    a, b = load_model(summary["draft"]).model.arrays(), load_model(second["draft"]).model.arrays()
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert [r["step"] for r in log_of(run)] == list(range(1, STEPS + 1))


def test_missing_corrupt_or_mismatched_checkpoints_are_clear_errors(trained, tmp_path):
    tc, folder, _ = trained
    with pytest.raises(ValueError, match="nothing to resume"):
        train_draft(tc, tmp_path / "empty", resume=True, progress=False)
    run = tmp_path / "copy"
    shutil.copytree(folder / "run", run)
    with pytest.raises(ValueError, match=r"the config changed since checkpoint .*: learning_rate \(0.003 -> 0.0001\)"):
        train_draft(dataclasses.replace(tc, learning_rate=1e-4), run, resume=True, progress=False)
    latest = max((run / "checkpoints").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    for f in (latest / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=f"checkpoint .*{latest.name}.* cannot be read"):
        train_draft(tc, run, resume=True, progress=False)


def config_file(tc: TrainConfig, path: pathlib.Path) -> pathlib.Path:
    """``tc`` as a train config file (for the command line)."""
    import yaml

    path.write_text(yaml.safe_dump(tc.to_dict()))
    return path


def test_resume_with_another_kind_names_every_changed_key_in_one_line(trained, tmp_path, capsys):
    """Checked before the checkpoint is restored: orbax's refusal of the other tree was a 119-line dump."""
    tc, folder, _ = trained
    run = tmp_path / "run"
    shutil.copytree(folder / "run", run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    args = ["train-draft", "--config", str(config_file(tc, tmp_path / "t.yaml")), "--out", str(run), "--resume"]
    assert main([*args, "--kind", "eagle", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert (f"--resume: the config changed since checkpoint {run / 'checkpoints' / str(STEPS)}: kind ('model' -> "
            "'eagle'), seed (0 -> 5); resume with the same flags and --config, or train into a new --out") in err, err
    assert main([*args, "--steps", str(STEPS - 2)]) == 2
    assert f"steps {STEPS - 2} is below the step of checkpoint" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing written


def test_resume_with_more_steps_extends_the_run_on_the_first_schedule(trained, tmp_path):
    """`--resume --steps N` after a finished run trains the steps past it from its checkpoint, at the final
    rate of the run's first schedule; an extension stopped and resumed ends with the same weights."""
    tc, folder, summary = trained
    more = STEPS + 3
    runs = {}
    for name in ("whole", "stopped"):
        runs[name] = tmp_path / name
        shutil.copytree(folder / "run", runs[name])
    args = ["train-draft", "--config", str(config_file(tc, tmp_path / "t.yaml")), "--resume", "--steps", str(more)]
    assert main([*args, "--out", str(runs["whole"])]) == 0
    assert [r["step"] for r in log_of(runs["whole"])] == list(range(1, more + 1))
    extended = dataclasses.replace(tc, steps=more)
    first = train_draft(extended, runs["stopped"], resume=True, progress=False, stop_after=2)
    assert first["steps"] == STEPS + 2 and not first["finished"]
    second = train_draft(extended, runs["stopped"], resume=True, progress=False)
    assert second["finished"] and second["steps"] == more
    a = load_model(str(runs["whole"] / "draft")).model.arrays()
    b, before = load_model(second["draft"]).model.arrays(), load_model(summary["draft"]).model.arrays()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert any(not np.array_equal(a[name], before[name]) for name in a)  # the extension trained
    meta = json.loads((runs["whole"] / "checkpoints" / str(more) / "meta" / "metadata").read_text())
    assert meta["schedule_steps"] == STEPS and meta["config"]["steps"] == more
    schedule = learning_rate_schedule(extended, STEPS)
    assert float(schedule(STEPS)) == float(schedule(more - 1)) == pytest.approx(0.1 * tc.learning_rate)


def test_exported_draft_loads_by_path_and_drafts_losslessly(trained):
    _, _, summary = trained
    draft = load_model(summary["draft"])
    assert draft.config.output_vocab_size == 64 and draft.config.num_layers == 1
    vocab_map = draft.model.arrays()["vocab_map"]
    assert len(set(vocab_map.tolist())) == 64 and H.target().tokenizer.eos_id in vocab_map
    out = engine.generate(H.target(), H.RAGGED, ModelDrafter(draft.config, draft.model.params()), gamma=3,
                          max_new_tokens=H.MAX_NEW, eos_id=H.eos_id())
    assert out.tokens == H.reference().tokens
    assert out.metrics.draft_tokens > 0


def test_cli_train_draft_and_its_errors(trained, tmp_path, capsys):
    _, folder, _ = trained
    assert main(["train-draft", "--out", str(tmp_path / "x"), "--steps", "0"]) == 2
    assert "steps must be an int >= 1" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    assert main(["train-draft", "--config", str(bad), "--out", str(tmp_path / "y")]) == 2
    assert "unknown key 'stepz'" in capsys.readouterr().err
    assert main(["train-draft", "--out", str(folder / "run"), "--target", "tiny-random",
                 "--prompts-file", prompts_file(str(folder))]) == 2
    assert "already has checkpoints" in capsys.readouterr().err


def test_every_train_config_in_configs_loads():
    files = sorted((pathlib.Path(__file__).resolve().parents[1] / "configs" / "train").glob("*.yaml"))
    assert files
    kinds = set()
    for path in files:
        tc = train_config(path)
        target = types.SimpleNamespace(config=H.target().config if tc.target == "tiny-random" else _smollm2_shape(),
                                       tokenizer=H.target().tokenizer)  # a DFlash drafter's default mask token
        setup = kind_of(tc).setup(target, tc)  # the architecture the file describes builds
        kinds.add(tc.kind)
        if tc.kind == "model":
            assert setup.num_layers == tc.num_layers
        elif tc.kind == "dflash":
            assert (setup.drafter.layer.hidden_size, setup.drafter.layer.num_layers, setup.drafter.block_size) == \
                (target.config.hidden_size, tc.num_layers, tc.block_size)
        else:  # an EAGLE-3 head's width is its decoder's
            head = setup.head.layer if isinstance(setup.head, Eagle3Config) else setup.head
            assert head.hidden_size == target.config.hidden_size
    assert kinds == {"model", "eagle", "medusa", "dflash"}


def _smollm2_shape():
    from specdec_jax.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_embeddings=True)


def test_batches_are_a_function_of_the_step():
    first = [batch_indices(10, 4, s, seed=0) for s in range(6)]
    assert [batch_indices(10, 4, s, seed=0).tolist() for s in range(6)] == [b.tolist() for b in first]
    epoch = np.concatenate(first[:2])
    assert len(set(epoch.tolist())) == 8  # two steps of an epoch never repeat an example
    assert first[2].tolist() != first[0].tolist()  # a new epoch is a new permutation


def test_copied_layers_are_the_first_ones():
    assert copied_layers(30, 2) == [0, 1] and copied_layers(4, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot copy"):
        copied_layers(4, 5)


def test_vocab_keeps_forced_ids_then_the_heaviest():
    from specdec_jax.distill.data import Dataset

    ids = np.array([[[3, 1], [3, 2]]])  # [N=1,S=2,k=2]
    logp = np.log(np.array([[[0.9, 0.1], [0.6, 0.4]]], np.float32))
    data = Dataset(np.zeros((1, 2), np.int32), ids, logp, np.ones((1, 2), np.float32))
    assert vocab_by_frequency(data, 2, 8, always=[7]).tolist() == [3, 7]
    assert vocab_by_frequency(data, 3, 8, always=[7]).tolist() == [2, 3, 7]


def test_distill_loss_is_zero_agreement_one_for_the_teacher_itself():
    """A draft equal to the target, scored on the target's own top-1 law, has loss 0 and agreement 1."""
    target = H.target()
    tokens = jnp.asarray([H.RAGGED[3][:16]], jnp.int32)
    logits, _ = target.model(tokens, target.config.init_cache(1, 16))
    top = jnp.argmax(logits, -1)[..., None]
    batch = {"tokens": tokens, "top_ids": top, "top_logp": jnp.zeros(top.shape), "weight": jnp.ones(tokens.shape)}
    _, metrics = distill_loss(target.config, target.model.params(), batch)
    assert float(metrics["agreement"]) == 1.0
    expected = -jnp.mean(jnp.max(jax.nn.log_softmax(logits, axis=-1), axis=-1))
    assert float(metrics["loss"]) == pytest.approx(float(expected), rel=1e-5)


def test_engine_records_the_target_top_k_of_every_emitted_token():
    """Through speculative rounds (several tokens emitted per round); the `trained` fixture's data
    build covers plain decoding."""
    out = engine.generate(H.target(), H.RAGGED, H.ngram(), gamma=3, max_new_tokens=H.MAX_NEW, eos_id=H.eos_id(),
                          record_top_k=3)
    assert out.tokens == H.reference().tokens
    cfg, params = H.target().config, H.target().model.params()
    for prompt, tokens, (ids, logp) in zip(H.RAGGED, out.tokens, out.target_top):
        assert ids.shape == logp.shape == (len(tokens), 3)
        assert ids[:, 0].tolist() == tokens  # greedy: the emitted token is the target's top-1
        assert np.all(np.diff(logp, axis=1) <= 0) and np.all(logp <= 0)
        teacher = H.teacher_logits(cfg, params, prompt + tokens)[len(prompt) - 1 : -1]  # law of each emitted token
        expected = np.asarray(jax.nn.log_softmax(teacher, axis=-1))
        np.testing.assert_allclose(logp, np.take_along_axis(expected, ids, axis=1), atol=1e-4)


def test_reduced_vocab_draft_proposes_only_its_ids_and_q_is_zero_elsewhere():
    base = load_model("tiny-random-draft")
    arrays = base.model.arrays()
    keep = np.arange(0, base.config.vocab_size, 3, dtype=np.int32)
    cfg = dataclasses.replace(base.config, tie_embeddings=False, output_vocab_size=len(keep))
    arrays["lm_head"] = arrays["embed"][keep]
    arrays["vocab_map"] = keep
    drafter = ModelDrafter(cfg, Llama.from_arrays(cfg, arrays).params())
    run = H.prepare(H.RAGGED, drafter, gamma=3, sampling=SamplingParams(temperature=1.0))
    proposal = engine.draft_step(run.spec, run.params, run.state).proposal
    assert np.isin(np.asarray(proposal.drafts), keep).all()
    probs = np.asarray(proposal.probs)
    assert probs.shape[-1] == base.config.vocab_size
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.delete(probs, keep, axis=-1) == 0)

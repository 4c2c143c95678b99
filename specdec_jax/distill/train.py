"""`specdec-jax train-draft`: distil a draft model from a target, checkpointed and resumable.

Layout of the output folder OUT::

    data/train.npz, data/heldout.npz   distillation data (built once; see distill.data): decoded
                                       answers (kind model) or teacher-forced features (eagle, medusa)
    checkpoints/<step>/                orbax CheckpointManager: trainable weights, optimizer
                                       state, and meta (step, config, data position)
    log.jsonl                          one line per step: loss, agreement, tokens/s; eval lines
    training_curve.png                 training loss and held-out agreement against step
    draft/ or head/                    the result: `--draft-model OUT/draft` (kind model) or
                                       `--drafter eagle|medusa --draft-model OUT/head`

What differs between kinds (architecture, initialisation, frozen weights, loss,
export) lives in `distill.kinds`; everything else is this one pipeline.

The run is deterministic given the config: batches come from seeded
permutations indexed by step (`distill.data.batch_indices`), so `--resume`
from the last checkpoint reproduces the uninterrupted run's weights exactly.

`--resume` takes the config the checkpoint was written with, checked before
anything is loaded: any other change is refused, naming every changed key,
except the keys of RESUMABLE_KEYS. A larger `steps` extends the run (400 steps,
then `--resume --steps 450`: steps 401..450 from the checkpoint). The learning
rate schedule stays the one of the run's first `steps` (`schedule_steps`, kept in
every checkpoint): the steps past it train at its final rate, 10% of the peak.
Rule: a schedule is never stretched over steps already taken; a cosine redrawn
over 450 steps would raise the rate the first 400 had annealed (back to 71% of
the peak for 400 -> 1000) and the extended run would match no uninterrupted one.
"""

from __future__ import annotations

import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from specdec_jax import interrupts
from specdec_jax.data import spec_bench_questions
from specdec_jax.distill.chitchat import chitchat_records
from specdec_jax.distill.config import TrainConfig
from specdec_jax.distill.data import (Dataset, batch_indices, build_dataset, build_feature_dataset, split_questions,
                                      training_prompts, vocab_by_frequency)
from specdec_jax.distill.kinds import head_target_info, head_vocab, kind_of
from specdec_jax.files import exclusive, write_text_atomic
from specdec_jax.models import load_model
from specdec_jax.models.loaded import LoadedModel


RESUMABLE_KEYS = ("steps", "save_every", "eval_every", "keep_checkpoints")  # may change on --resume (docstring)


def learning_rate_schedule(tc: TrainConfig, schedule_steps: int | None = None) -> optax.Schedule:
    """Linear warmup then cosine decay to 10% of the peak at ``schedule_steps`` (default ``tc.steps``:
    the run's first total, module docstring), constant at 10% after it."""
    return optax.warmup_cosine_decay_schedule(0.0, tc.learning_rate, tc.warmup_steps, schedule_steps or tc.steps,
                                              end_value=0.1 * tc.learning_rate)


def optimizer(tc: TrainConfig, schedule_steps: int | None = None) -> optax.GradientTransformation:
    """AdamW on `learning_rate_schedule`, after global-norm clipping; norms are not decayed."""
    decay = lambda params: {k: not k.endswith("norm") for k in params}  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                       optax.adamw(learning_rate_schedule(tc, schedule_steps), weight_decay=tc.weight_decay,
                                   mask=decay))


@functools.cache
def compiled(setup, tc: TrainConfig, schedule_steps: int):
    """(optimizer, train_step, evaluate) of an architecture, train config and schedule length, built
    once per process (a resumed run in the same process reuses the compiled step)."""
    opt, kind = optimizer(tc, schedule_steps), kind_of(tc)
    return opt, make_train_step(kind, setup, opt), make_eval(kind, setup, tc.batch_size)


def make_train_step(kind, setup, opt: optax.GradientTransformation):
    """jitted (trainable, opt_state, frozen, batch) -> (trainable, opt_state, metrics)."""

    def step(trainable, opt_state, frozen, batch):
        grad_fn = jax.grad(lambda t: kind.loss(setup, {**frozen, **t}, batch, True), has_aux=True)
        grads, metrics = grad_fn(trainable)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval(kind, setup, batch_size: int):
    """jitted held-out metrics over a whole Dataset, in batches of `batch_size` windows."""
    metrics = jax.jit(lambda params, batch: kind.loss(setup, params, batch, False)[1])

    def evaluate(params, data: Dataset) -> dict:
        totals, weight = {}, 0.0
        for start in range(0, len(data), batch_size):
            batch = data.batch(np.arange(start, min(start + batch_size, len(data))))
            w = float(batch["weight"].sum())
            for k, v in metrics(params, batch).items():
                totals[k] = totals.get(k, 0.0) + float(v) * w
            weight += w
        return {k: v / max(weight, 1.0) for k, v in totals.items()}

    return evaluate


def train_draft(tc: TrainConfig, out: str | pathlib.Path, resume: bool = False, progress: bool = True,
                stop_after: int | None = None) -> dict:
    """Builds (or reads) the data, trains, checkpoints, evaluates and writes OUT/draft.

    stop_after: return after this many steps of this call (the checkpoint at that
    step is saved), as a kill would; `resume=True` continues. Returns a summary dict.
    """
    out = pathlib.Path(out).resolve()
    with exclusive(out, "train-draft"):
        return _train(tc, out, resume, progress, stop_after)


def latest_checkpoint(out: str | pathlib.Path) -> str:
    """The newest checkpoint of a training folder, in words (what an interrupted training keeps)."""
    steps = [int(p.name) for p in (pathlib.Path(out) / "checkpoints").glob("*") if p.name.isdigit()]
    if not steps:
        return f"no checkpoint yet in {out}"
    return f"the checkpoint of step {max(steps)} in {pathlib.Path(out) / 'checkpoints'} (continue with --resume)"


def _train(tc: TrainConfig, out: pathlib.Path, resume: bool, progress: bool, stop_after: int | None) -> dict:
    """The body of `train_draft`, holding ``out``'s lock."""
    manager, schedule_steps = _checkpoints(out, tc, resume)
    target, kind = load_model(tc.target), kind_of(tc)
    setup = kind.setup(target, tc)
    train_data, heldout_data = _datasets(target, tc, out, progress)
    vocab_map, reduced = None, head_vocab(target, tc)
    if reduced is not None:
        vocab_map = vocab_by_frequency(train_data, reduced, target.config.vocab_size, list(target.tokenizer.stop_ids))
    arrays = kind.init(setup, target, tc, vocab_map)
    tokenizer, target_info = target.tokenizer, head_target_info(target)
    del target
    frozen = {k: jax.tree.map(jnp.asarray, v) for k, v in arrays.items() if k in kind.frozen(tc)}
    trainable = {k: jnp.asarray(v) for k, v in arrays.items() if k not in kind.frozen(tc)}
    opt, train_step, evaluate = compiled(setup, tc, schedule_steps)
    opt_state = opt.init(trainable)
    start = 0
    if resume:
        start, trainable, opt_state = _restore(manager, trainable, opt_state)
        _truncate_log(out / "log.jsonl", start)
    last = min(tc.steps, start + stop_after) if stop_after is not None else tc.steps
    bar = tqdm(range(start, last), desc="train-draft", unit="step", disable=not progress, initial=start,
               total=tc.steps)
    # A fresh run starts a new log: an old one is from a run killed before its first checkpoint.
    with (out / "log.jsonl").open("a" if resume else "w") as log:
        try:
            for step in bar:
                batch = {**train_data.batch(batch_indices(len(train_data), tc.batch_size, step, tc.seed)),
                         "step": np.int32(step)}
                tick = time.perf_counter()
                trainable, opt_state, metrics = train_step(trainable, opt_state, frozen, batch)
                metrics = {k: float(v) for k, v in metrics.items()}
                rate = batch["weight"].sum() / (time.perf_counter() - tick)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", agree=f"{metrics['agreement']:.2f}", tok_s=f"{rate:.0f}")
                record = {"step": step + 1, **metrics, "tokens_per_s": float(rate)}
                if (step + 1) % tc.eval_every == 0 or step + 1 == tc.steps:
                    record["heldout"] = evaluate({**frozen, **trainable}, heldout_data)
                log.write(json.dumps(record) + "\n")
                log.flush()
                if (step + 1) % tc.save_every == 0 or step + 1 in (last, tc.steps):
                    with interrupts.deferred():
                        _save(manager, step + 1, tc, schedule_steps, trainable, opt_state)
        finally:  # an interrupt too: the checkpoint being written completes, orbax's threads end
            with interrupts.deferred():
                manager.wait_until_finished()
                manager.close()
    done = last == tc.steps
    summary = {"steps": last, "finished": done, "out": str(out)}
    if done:
        heldout = evaluate({**frozen, **trainable}, heldout_data)
        params = jax.tree.map(np.asarray, {**frozen, **trainable})
        info = {"kind": tc.kind, "target": tc.target, "train_config": tc.to_dict(), "heldout": heldout}
        path = kind.export(out, setup, params, tokenizer, target_info, info)
        summary.update(heldout=heldout, draft=str(path))
        plot_training(out / "log.jsonl", out / "training_curve.png")
    return summary


def _checkpoints(out: pathlib.Path, tc: TrainConfig, resume: bool):
    """(the checkpoint manager of ``out``, the steps the learning-rate schedule spans), checked before any
    model or data loads: a resume needs a checkpoint of the same config, a fresh run none."""
    manager = _checkpoint_manager(out, tc)
    if resume and manager.latest_step() is None:
        raise ValueError(f"nothing to resume: no checkpoint in {out / 'checkpoints'}")
    if not resume and manager.latest_step() is not None:
        raise ValueError(f"{out} already has checkpoints: pass --resume to continue, or choose another --out")
    return manager, (_resumable(manager, tc) if resume else tc.steps)


def _datasets(target: LoadedModel, tc: TrainConfig, out: pathlib.Path, progress: bool) -> tuple[Dataset, Dataset]:
    """Training and held-out data, built once into OUT/data and read back after."""
    folder = out / "data"
    paths = folder / "train.npz", folder / "heldout.npz"
    if all(p.is_file() for p in paths):
        try:
            return Dataset.load(paths[0]), Dataset.load(paths[1])
        except ValueError as err:  # a file cut by a kill or a full disk: built again
            print(f"{err}; building the data again", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    train_q, heldout_q = split_questions(spec_bench_questions(tc.prompts_file), tc.heldout_per_category)
    train_records = training_prompts(train_q, tc.max_train_prompts)
    heldout_records = [{"id": str(q["question_id"]), "prompt": q["turns"][0]} for q in heldout_q][: tc.eval_prompts]
    datasets, layers = [], kind_of(tc).data_layers(tc, target.config.num_layers)
    for records, path in zip((train_records, heldout_records), paths):
        data = (build_dataset(target, tc, records, progress) if layers is None
                else build_feature_dataset(target, tc, records, layers, progress))
        if path == paths[0] and tc.extra_text == "chitchat" and tc.extra_examples:
            extra = chitchat_records(target.tokenizer, tc.extra_examples, progress)
            data = Dataset.concatenate([data, build_feature_dataset(target, tc, extra, layers, progress, answers=False)])
        data.save(path)
        datasets.append(data)
    write_text_atomic(folder / "split.json", json.dumps(
        {"heldout_per_category": tc.heldout_per_category, "train_ids": sorted({q["question_id"] for q in train_q}),
         "heldout_ids": sorted(q["question_id"] for q in heldout_q)}))
    return datasets[0], datasets[1]


def _checkpoint_manager(out: pathlib.Path, tc: TrainConfig) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=tc.keep_checkpoints, create=True)
    return ocp.CheckpointManager(out / "checkpoints", options=options)


def _save(manager, step: int, tc: TrainConfig, schedule_steps: int, trainable, opt_state) -> None:
    meta = {"step": step, "config": tc.to_dict(), "schedule_steps": schedule_steps,
            "data_position": {"next_step": step, "seed": tc.seed}}
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"trainable": trainable, "opt_state": opt_state}),
        meta=ocp.args.JsonSave(meta)), force=True)


def _resumable(manager, tc: TrainConfig) -> int:
    """The schedule length of the run the latest checkpoint belongs to, if ``tc`` may resume it: the
    same config but for RESUMABLE_KEYS, and ``steps`` not below the checkpoint's step; else a
    ValueError naming every changed key (module docstring)."""
    step = manager.latest_step()
    where = manager.directory / str(step)
    meta = _checkpoint_part(manager, step, meta=ocp.args.JsonRestore())["meta"]
    # a field newer than the checkpoint: its default; eagle_version: checkpoints without it are EAGLE-1 heads
    saved = {**TrainConfig().to_dict(), "eagle_version": 1, **meta["config"]}
    changed = [f"{k} ({saved[k]!r} -> {v!r})" for k, v in tc.to_dict().items()
               if k not in RESUMABLE_KEYS and saved[k] != v]
    if changed:
        raise ValueError(f"--resume: the config changed since checkpoint {where}: {', '.join(changed)}; resume with "
                         "the same flags and --config, or train into a new --out")
    if tc.steps < step:
        raise ValueError(f"--resume: steps {tc.steps} is below the step of checkpoint {where}: give --steps {step} "
                         "or more (more extends the run)")
    return int(meta.get("schedule_steps", saved["steps"]))


def _restore(manager, trainable, opt_state):
    """(step, trainable, opt_state) of the latest checkpoint (its config checked by `_resumable`)."""
    step = manager.latest_step()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"trainable": trainable, "opt_state": opt_state})
    restored = _checkpoint_part(manager, step, state=ocp.args.StandardRestore(abstract))
    state = restored["state"]
    return step, state["trainable"], state["opt_state"]


def _checkpoint_part(manager, step: int, **items):
    """``items`` (orbax restore args by name) of checkpoint ``step``; an unreadable checkpoint is a
    ValueError of one line naming it (orbax's own messages can hold whole tree dumps)."""
    try:
        return manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as err:  # noqa: BLE001 - orbax raises many kinds: name the checkpoint
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"checkpoint {manager.directory / str(step)} cannot be read ({err.__class__.__name__}: "
                         f"{first}); delete it to resume from an earlier one") from None


def read_log(path: pathlib.Path) -> list[dict]:
    """The records of a training log; a last line cut by a kill is left out, any other bad line is a
    ValueError naming it."""
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}: line {number} is not JSON") from None
    return records


def _truncate_log(path: pathlib.Path, step: int) -> None:
    """Drops log lines past `step` (written after the checkpoint a resume starts from) and a cut last line."""
    if path.is_file():
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in read_log(path) if r["step"] <= step))


def plot_training(log_path: pathlib.Path, png: pathlib.Path) -> None:
    """Training loss (per step) and held-out loss and agreement (per evaluation) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_log(log_path)
    evals = [r for r in records if "heldout" in r]
    fig, (ax_loss, ax_agree) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in records], [r["loss"] for r in records], lw=0.8, label="train")
    ax_loss.plot([r["step"] for r in evals], [r["heldout"]["loss"] for r in evals], "o-", label="held-out")
    ax_loss.set(xlabel="step", ylabel="distillation loss (nats)", title="loss")
    ax_loss.legend()
    ax_agree.plot([r["step"] for r in records], [r["agreement"] for r in records], lw=0.8, label="train")
    ax_agree.plot([r["step"] for r in evals], [r["heldout"]["agreement"] for r in evals], "o-", label="held-out")
    ax_agree.set(xlabel="step", ylabel="draft argmax = target argmax", title="greedy agreement", ylim=(0, 1))
    ax_agree.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)

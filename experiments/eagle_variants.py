"""Which training change buys the EAGLE head acceptance, measured on the EAGLE recipe's cached data.

Makes the entry "Which training change buys the EAGLE head acceptance?" of experiments/README.md.

    python experiments/eagle_variants.py --steps 100 --variant base --variant ce1:ce_weight=1.0 \\
        --variant ceonly:ce_weight=1.0,regression_weight=0

(`--variant ttt2:ttt_steps=2` trains with EAGLE-3's training-time test.) Each variant is `configs/train/smollm2-eagle.yaml` with `--steps` and its own overrides
(`name:key=value,key=value`), trained from scratch on the data `experiments/eagle_recipe.py`
cached in `<cache>/heads/smollm2-eagle/data` (run the recipe first; nothing is rebuilt), into
`<cache>/heads/variants/<name>-<steps>`. Every variant is then evaluated the same way on the held-out
windows (question ids never trained on), teacher-forced, with a 2-step training-time test
unrolled for all of them:

- `agreement`: the head's first draft is the target's argmax, over every position;
- `answer_agreement`: the same over the assistant's answer positions only (after the last
  `<|im_start|>assistant` line of a window): the positions whose drafts are verified in generation;
- `answer_agreement_step2`, `_step3`: drafts 2 and 3 of a chain fed the head's own features
  (the tokens before them right), on answer positions.

Writes `experiments/results/eagle_variants/summary.json` and `table.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import numpy as np
import yaml
from common import HEAD_CONFIGS, RESULTS, markdown_table, run_folder

from specdec_jax.distill.config import train_config
from specdec_jax.distill.data import Dataset
from specdec_jax.distill.kinds import kind_of, shared_target_weights
from specdec_jax.distill.train import make_eval, train_draft
from specdec_jax.drafters import load_head
from specdec_jax.models import load_model
from specdec_jax.cache import cache_dir

EVAL_TTT_STEPS = 2  # drafts 2 and 3 evaluated for every variant


def parse_variant(text: str) -> tuple[str, dict]:
    """'name:key=value,key=value' -> (name, {key: YAML-parsed value})."""
    name, _, rest = text.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"variant {text!r}: expected key=value, got {item!r}")
        overrides[key.replace("-", "_")] = yaml.safe_load(value)
    return name, overrides


def answer_mask(tokens: np.ndarray, tokenizer) -> np.ndarray:
    """f32[N,S-1]: 1 for the inputs j whose prediction (the target's law at j + 1, of token j + 2) is
    a drafted token: token j + 2 comes after the first answer token a (which the prefill emits)."""
    header = tokenizer.encode("<|im_start|>assistant\n")
    mask = np.zeros((tokens.shape[0], tokens.shape[1] - 1), np.float32)
    for n, row in enumerate(tokens):
        ends = [i + len(header) for i in range(len(row) - len(header) + 1)
                if row[i : i + len(header)].tolist() == header]
        if ends:
            mask[n, max(ends[-1] - 1, 0):] = 1.0  # j + 2 >= a + 1
    return mask


def evaluate(target, tc, head_path: pathlib.Path, heldout: Dataset, answers: np.ndarray) -> dict:
    """Held-out agreement (all positions; answer positions at drafts 1-3) of a trained head."""
    eval_tc = dataclasses.replace(tc, ttt_steps=EVAL_TTT_STEPS)
    kind = kind_of(eval_tc)
    setup = kind.setup(target, eval_tc)
    params = {**load_head(head_path).params, "target": shared_target_weights(target)}
    run = make_eval(kind, setup, tc.batch_size)
    every = run(params, heldout)
    weight = heldout.weight.copy()
    weight[:, 1:] *= answers
    on_answers = run(params, Dataset(heldout.tokens, heldout.top_ids, heldout.top_logp, weight, heldout.features))
    return {"agreement": every["agreement"], "answer_agreement": on_answers["agreement"],
            **{f"answer_agreement_step{s}": on_answers[f"agreement_step{s}"] for s in range(2, EVAL_TTT_STEPS + 2)},
            "answer_positions": float(weight[:, 1:].sum())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True, metavar="NAME:K=V,...")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "eagle_variants")
    args = parser.parse_args(argv)
    data = run_folder("eagle") / "data"
    if not (data / "split.json").is_file():
        raise SystemExit(f"no cached EAGLE data in {data}: run python experiments/eagle_recipe.py first")
    target = load_model(train_config(HEAD_CONFIGS["eagle"]).target)
    heldout = Dataset.load(data / "heldout.npz")
    answers = answer_mask(heldout.tokens, target.tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    for name, overrides in args.variant:
        tc = train_config(HEAD_CONFIGS["eagle"], steps=args.steps, **overrides)
        folder = cache_dir() / "heads" / "variants" / f"{name}-{args.steps}"
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "data").exists():
            (folder / "data").symlink_to(data, target_is_directory=True)
        tick = time.perf_counter()
        if not (folder / "head").is_dir():
            train_draft(tc, folder, resume=(folder / "checkpoints").is_dir() and any((folder / "checkpoints").iterdir()))
        train_s = time.perf_counter() - tick
        log = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
        summary[name] = {"overrides": overrides, "steps": args.steps, "train_s": train_s,
                         "train_agreement": float(np.mean([r["agreement"] for r in log[-10:]])),
                         **evaluate(target, tc, folder / "head", heldout, answers)}
        summary_path.write_text(json.dumps(summary, indent=1))
        print(name, summary[name], flush=True)
    columns = ["agreement", "answer_agreement", "answer_agreement_step2", "answer_agreement_step3", "train_agreement"]
    rows = [[name, json.dumps(s["overrides"]), s["steps"], *(f"{s[c]:.3f}" for c in columns), f"{s['train_s'] / 60:.1f}"]
            for name, s in summary.items()]
    table = markdown_table(["variant", "overrides", "steps", *columns, "train min"], rows)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

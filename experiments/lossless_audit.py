"""Lossless audit: greedy spec vs plain over Spec-Bench, and the sampling law on a toy model.

Makes the entry "Is speculative decoding lossless?" of experiments/README.md; writes results.json,
table.md and lossless_audit.png to experiments/results/lossless_audit (`--out`). Exits 1 if a
greedy output differs other than at a near-tie, or a chi-square p-value is under 1e-4.

    python experiments/lossless_audit.py --per-category 1 --max-new-tokens 64

Part A (SmolLM2-135M, greedy, n-gram gamma 4, batches of 8 ragged prompts):
plain and speculative outputs for the first --per-category questions of each
Spec-Bench category, compared token by token. A divergence is tolerated only at
a near-tie: the plain run's top-2 logit margin at the first differing position
below 1e-3 (docs/design.md section 6). Reported: exact-match rate, tie-aware equality,
and each divergence with its position and margin.

Part B (a 6-token random Llama): 65,536 sampled continuations of 3 tokens per
drafter through the engine (temperature 1), against the exact law of all 216
continuations (specdec_jax.audit), chi-square with cells expecting < 5 merged.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

from common import RESULTS, markdown_table, pyplot, save, spec_bench_subset
from specdec_jax.audit import chi_square, continuation_codes, noisy_copy, sequence_law
from specdec_jax.compare import compare_rows
from specdec_jax.config import run_config
from specdec_jax.drafters import ModelDrafter, NgramDrafter
from specdec_jax.engine import generate
from specdec_jax.models import LlamaConfig, load_model, random_llama
from specdec_jax.runner import run
from specdec_jax.sampling import SamplingParams

TOY = LlamaConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=8)
TOY_PROMPT, TOY_NEW, TOY_ROWS = [1, 2, 3, 1, 2], 3, 65_536


def greedy_audit(args) -> tuple[list, dict]:
    target = load_model(args.model)
    with spec_bench_subset(args.per_category) as prompts_file:
        base = dict(model=args.model, max_new_tokens=args.max_new_tokens, batch_size=8, prompts_file=str(prompts_file))
        plain = run(run_config(drafter="none", **base), target=target)["results"]
        spec = run(run_config(drafter="ngram", gamma=4, **base), target=target)["results"]
    exact, comparisons = compare_rows(target.config, target.model.params(), [r["prompt_tokens"] for r in plain],
                                      [r["tokens"] for r in plain], [r["tokens"] for r in spec])
    divergences = [[r["id"], r.get("category", "-"), c.index, c.margin, c.ok]
                   for r, c in zip(plain, comparisons) if not c.exact]
    summary = {"prompts": len(plain), "exact_match_rate": exact, "tie_aware_equal": all(c.ok for c in comparisons),
               "divergences": len(divergences)}
    return divergences, summary


def law_audit(seed: int) -> list:
    target = random_llama(TOY, 0)
    draft = noisy_copy(target)
    law = sequence_law(TOY, target.params(), TOY_PROMPT, TOY_NEW)
    rows = []
    # A budget of TOY_NEW = 3 tokens caps every round at 2 drafts, so gamma 2 is the largest that differs.
    for name, drafter, gamma in [("plain", None, 0), ("draft model", ModelDrafter(TOY, draft.params()), 1),
                                 ("draft model", ModelDrafter(TOY, draft.params()), 2), ("n-gram", NgramDrafter(), 2)]:
        out = generate(target, [TOY_PROMPT] * TOY_ROWS, drafter, gamma=gamma, max_new_tokens=TOY_NEW, seed=seed,
                       sampling=SamplingParams(temperature=1.0), capacity=16)
        counts = np.bincount(continuation_codes(np.asarray(out.tokens), TOY.vocab_size), minlength=law.size)
        stat, dof, pvalue = chi_square(counts, law)
        rows.append([name, gamma, TOY_ROWS, out.metrics.acceptance_rate, stat, dof, pvalue])
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "lossless_audit")
    args = parser.parse_args(argv)
    divergences, summary = greedy_audit(args)
    law_rows = law_audit(args.seed)
    table = (f"Greedy, {summary['prompts']} Spec-Bench prompts: exact match {summary['exact_match_rate']:.3f}, "
             f"tie-aware equal: {summary['tie_aware_equal']}, divergences: {summary['divergences']}\n\n"
             + markdown_table(["prompt id", "category", "first differing position", "plain top-2 margin",
                               "near-tie (ok)"], divergences)
             + "\nSampling law on a 6-token toy model (temperature 1, 3 new tokens, 216 cells):\n\n"
             + markdown_table(["drafter", "gamma", "rows", "acceptance", "chi2", "dof", "p-value"], law_rows))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([f"{r[0]} g={r[1]}" for r in law_rows], [r[6] for r in law_rows])
    ax.axhline(1e-4, color="red", lw=0.8, label="significance 1e-4")
    ax.set(yscale="log", ylabel="chi-square p-value", title="Spec sampling vs the exact target law")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    save(args.out, {"greedy": summary, "divergences": divergences, "law": law_rows}, table, fig,
         "lossless_audit.png")
    ok = summary["tie_aware_equal"] and all(r[6] > 1e-4 for r in law_rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Tokens per round, closed form vs simulation through `verify_greedy`.

Makes the entry "Does verification reproduce the closed form for tokens per round?" of
experiments/README.md.

    python experiments/expected_tokens.py [--rows 200000] [--out experiments/results/expected_tokens]

Each draft equals the target's argmax with probability alpha, independently; rounds go through
`verify_greedy`. Writes `results.json`, `table.md` and `tokens_per_round.png` into --out and
prints the table. Exits 1 unless every simulated mean is within 4 standard
errors of the closed form and the paper's reference values at gamma 4 (3.36 at
alpha 0.8, 2.31 at 0.6, 4.10 at 0.9) are reproduced within 0.01.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import numpy as np
from common import RESULTS, pyplot, save
from tqdm import tqdm

from specdec_jax.theory import expected_tokens_per_round, simulate_tokens_per_round, tokens_per_round_std

ALPHAS = (0.6, 0.8, 0.9)
REFERENCE_AT_GAMMA_4 = {0.6: 2.31, 0.8: 3.36, 0.9: 4.10}
GAMMAS = tuple(range(1, 9))


def run(rows: int, seed: int) -> list[dict]:
    records = []
    grid = [(a, g) for a in ALPHAS for g in GAMMAS]
    for i, (alpha, gamma) in enumerate(tqdm(grid, desc="alpha x gamma", unit="point")):
        key = jax.random.fold_in(jax.random.key(seed), i)
        n_emit = np.asarray(simulate_tokens_per_round(key, alpha, gamma=gamma, rows=rows))
        closed = expected_tokens_per_round(alpha, gamma)
        records.append(
            {
                "alpha": alpha,
                "gamma": gamma,
                "rows": rows,
                "simulated": float(n_emit.mean()),
                "closed_form": closed,
                "abs_error": abs(float(n_emit.mean()) - closed),
                "standard_error": tokens_per_round_std(alpha, gamma) / np.sqrt(rows),
            }
        )
    return records


def table(records: list[dict]) -> str:
    lines = ["| alpha | gamma | simulated | closed form | abs error | 3 x std error |", "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['alpha']} | {r['gamma']} | {r['simulated']:.4f} | {r['closed_form']:.4f} "
            f"| {r['abs_error']:.4f} | {3 * r['standard_error']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: list[dict]):
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for alpha in ALPHAS:
        rs = [r for r in records if r["alpha"] == alpha]
        gammas = [r["gamma"] for r in rs]
        (line,) = ax.plot(gammas, [r["closed_form"] for r in rs], label=f"closed form, alpha={alpha}")
        ax.plot(gammas, [r["simulated"] for r in rs], "o", color=line.get_color(), label=f"simulated, alpha={alpha}")
    ax.set_xlabel("gamma (drafts per round)")
    ax.set_ylabel("tokens per round")
    ax.set_title(f"Closed form (lines) vs {records[0]['rows']:,} simulated rounds (dots)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "expected_tokens")
    args = parser.parse_args(argv)

    records = run(args.rows, args.seed)
    save(args.out, {"seed": args.seed, "records": records}, table(records), plot(records), "tokens_per_round.png")
    ok = True
    for r in records:
        if r["abs_error"] > 4 * r["standard_error"]:
            ok = False
            print(f"FAIL: alpha {r['alpha']} gamma {r['gamma']} is {r['abs_error'] / r['standard_error']:.1f} std errors off")
        if r["gamma"] == 4:
            reference = REFERENCE_AT_GAMMA_4[r["alpha"]]
            hit = abs(r["simulated"] - reference) <= 0.01
            ok &= hit
            print(f"{'OK' if hit else 'FAIL'}: alpha {r['alpha']}, gamma 4: simulated {r['simulated']:.4f}, reference {reference}")
    print(f"{'OK' if ok else 'FAIL'}: wrote {args.out}/")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

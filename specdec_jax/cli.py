"""Command line: `specdec-jax SUBCOMMAND ...`.

Errors in user input print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys

from specdec_jax import theory


def _theory(args) -> int:
    closed = theory.expected_tokens_per_round(args.alpha, args.gamma)
    print(f"alpha {args.alpha}, gamma {args.gamma}: E[tokens per round] = {closed:.4f} (closed form)")
    if args.simulate:
        import jax
        import numpy as np

        n_emit = theory.simulate_tokens_per_round(jax.random.key(args.seed), args.alpha, gamma=args.gamma, rows=args.simulate)
        se = theory.tokens_per_round_std(args.alpha, args.gamma) / np.sqrt(args.simulate)
        print(f"simulated over {args.simulate:,} rounds: {float(np.mean(n_emit)):.4f} +- {se:.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec-jax", description="Speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("theory", help="closed-form tokens per round for acceptance alpha and gamma drafts")
    p.add_argument("--alpha", type=float, required=True, help="per-position acceptance probability in [0, 1]")
    p.add_argument("--gamma", type=int, required=True, help="drafts per round (>= 0)")
    p.add_argument("--simulate", type=int, default=0, metavar="ROWS", help="also simulate ROWS rounds")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_theory)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"specdec-jax: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

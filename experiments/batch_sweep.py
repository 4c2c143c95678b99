"""Experiment 3: throughput and speculative speedup vs batch size (speculation stops paying as the batch grows).

    python experiments/batch_sweep.py [--batches 1 4 16 32] [--max-new-tokens 64] [--repeats 1]

Ragged Spec-Bench prompts of copy-heavy categories (default extraction and
translation: the n-gram drafter finds drafts there, and prompts of 50-400
tokens keep the run short), the same prompt set for every batch size, plain
vs n-gram speculative decoding through `specdec_jax.bench`. Writes
results.json, table.md and batch_sweep.png to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

from specdec_jax.bench import bench
from specdec_jax.config import RunConfig
from specdec_jax.data import spec_bench_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32, help="prompts in the set (a multiple of every batch size)")
    parser.add_argument("--categories", nargs="+", default=["extraction", "translation"])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("experiments/results/batch_sweep"))
    args = parser.parse_args(argv)

    questions = [json.loads(line) for line in spec_bench_path().read_text().splitlines() if line.strip()]
    copy_heavy = [q for q in questions if q["category"] in args.categories]
    chosen = copy_heavy[: args.prompts]
    args.out.mkdir(parents=True, exist_ok=True)
    folder = tempfile.TemporaryDirectory()  # Spec-Bench text is read at run time, never written to the repository
    prompts_file = pathlib.Path(folder.name) / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps({"id": q["question_id"], "prompt": q["turns"][0]}) for q in chosen))
    records = []
    for batch in args.batches:
        cfg = RunConfig(model=args.model, drafter="ngram", gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                        batch_size=batch, prompts_file=str(prompts_file))
        overall = bench(cfg, repeats=args.repeats)["overall"]
        records.append({"batch": batch, **overall})
        print(f"batch {batch}: end to end plain {overall['plain_e2e_tokens_per_s']:.1f} tok/s, spec "
              f"{overall['spec_e2e_tokens_per_s']:.1f} tok/s, speedup {overall['e2e_speedup']:.2f}x; "
              f"Tv/T1 {overall['Tv_over_T1']:.2f}", flush=True)
    folder.cleanup()
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "records": records}, indent=1))
    lines = ["| batch | plain tok/s (end to end) | spec tok/s (end to end) | speedup (end to end) | speedup (decode "
             "phase) | tokens/round | T1 ms | Tv ms | Tv/T1 | predicted (decode) | spec = plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['batch']} | {r['plain_e2e_tokens_per_s']:.1f} | {r['spec_e2e_tokens_per_s']:.1f} | "
                     f"{r['e2e_speedup']:.2f}x | {r['speedup']:.2f}x | {r['tokens_per_round']:.2f} | {r['T1_ms']:.1f} | "
                     f"{r['Tv_ms']:.1f} | {r['Tv_over_T1']:.2f} | {r['predicted_speedup']:.2f}x | "
                     f"{r['tie_aware_equal']} ({r['exact_match_rate']:.2f} exact) |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(records, args.out / "batch_sweep.png")
    return 0


def plot(records: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in records]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.plot(batches, [r["plain_e2e_tokens_per_s"] for r in records], "o-", label="plain")
    left.plot(batches, [r["spec_e2e_tokens_per_s"] for r in records], "s-", label="n-gram speculative")
    left.set(xscale="log", xlabel="batch size", ylabel="tokens/s (end to end)", title="Throughput")
    left.set_xticks(batches, [str(b) for b in batches])
    left.legend()
    right.plot(batches, [r["e2e_speedup"] for r in records], "o-", label="measured, end to end")
    right.plot(batches, [r["speedup"] for r in records], "s:", label="measured, decode phase")
    right.plot(batches, [r["predicted_speedup"] for r in records], "x--", label="cost model (decode)")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set(xscale="log", xlabel="batch size", ylabel="speculative / plain", title="Speedup")
    right.set_xticks(batches, [str(b) for b in batches])
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

"""Command line: `specdec-jax {demo,generate,bench,sweep,train-draft,theory} ...`.

Errors in user input print one line on stderr and exit with code 2 (no traceback).
A failure of the jax runtime (out of memory, a device error) is not the user's:
it propagates with its traceback (exit code 1). Ctrl-C or SIGTERM stops any
command within seconds with one line saying what was kept, exit code 130 or 143
(`specdec_jax.interrupts`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import traceback
import typing
from collections.abc import Callable

import jax

from specdec_jax import files, interrupts, theory
from specdec_jax.config import KEYS, RunConfig, load_yaml, resolve
from specdec_jax.drafters.table import PLAIN, drafters, names_where

FLAG_HELP = {  # the drafters a setting is for are added from the table of drafters (`flag_help`)
    "model": "registry name or path (.gguf file / Hugging Face dir); default smollm2-135m",
    "draft_model": "a draft model's name or path, or a trained head folder",
    "dflash_block": "the block a DFlash pass drafts: t0 and B - 1 masks, at most the drafter's trained size "
                    "(0 = that size); --gamma auto verifies up to B - 1 of them",
    "draft_vocab": "the draft's logits over N vocabulary ids (--draft-vocab-source) and its stop ids only, a "
                   "cheaper head; 0 = its whole vocabulary",
    "draft_vocab_source": "which N ids --draft-vocab keeps: ids = the first N (BPE merge order), or the N most "
                          "frequent in a text source: sharegpt, a .jsonl file or a folder, as --datastore (counted "
                          "once, cached)",
    "draft_confidence": "a chain stops after its first draft whose probability under the drafter's law is below "
                        "this (its later draft steps are skipped); 0 = every chain is gamma long",
    "dtype": "weights, activations and KV cache of the target and draft model: float32 or bfloat16 (matrix "
             "products in it; norms, softmax and logits in float32)",
    "gamma": "drafts per round (0 = plain decoding), or auto: chosen each round from this device's measured "
             "costs and each row's acceptance",
    "temperature": "0 = greedy",
    "top_k": "0 = off",
    "top_p": "1 = off",
    "min_p": "0 = off",
    "repetition_penalty": "divides positive (multiplies negative) logits of prompt and generated tokens; 1 = off",
    "presence_penalty": "subtracted from the logit of every token generated so far; 0 = off",
    "frequency_penalty": "subtracted per occurrence of a token generated so far; 0 = off",
    "logit_bias": "TOKEN=BIAS: added to that token's logit before every other transform, in the target's and the "
                  "drafter's laws; -inf bans it (repeatable)",
    "logprobs": "report each emitted token's log-prob and its K (0-20) most likely alternatives (--json: 'logprobs')",
    "logprobs_mode": "raw: the target's log_softmax of its logits; processed: the law the run samples from (bias, "
                     "penalties, temperature, top-k/p, min-p, grammar)",
    "max_new_tokens": "token budget per prompt",
    "seed": "random seed",
    "batch_size": "prompts per batch",
    "prompt": "a prompt text (repeatable)",
    "prompts_file": "JSONL with 'prompt', or Spec-Bench 'turns' (first turn used)",
    "raw": "send prompt text as is (no chat template)",
    "ignore_eos": "do not stop at the model's end tokens (its EOS, EOT ...); --stop-id still stops",
    "stop_id": "a token id that also ends a row, kept in the output (repeatable)",
    "oracle_alpha": "the probability that a draft is the target's own token",
    "ngram_max": "longest n-gram the lookup tries",
    "ngram_min": "shortest n-gram the lookup tries",
    "datastore": "sharegpt, a .jsonl file of texts or chats, a folder of text/code files (tokenised and indexed "
                 "once, cached), or outputs: the model's own outputs of earlier batches (repeatable)",
    "mesh": "device mesh, e.g. data=4,model=2 (rows on data; heads and MLP on model); None: every device on data",
    "tree_nodes": "draft a token tree of this many nodes (default depth x topk), or auto: each round verifies the "
                  "best 0, 1, 2, 4, 8, 16 .. depth x topk of them",
    "tree_depth": "deepest tree node (default 4 with a tree)",
    "tree_topk": "children per expanded node: matches, or top-k tokens or ranks (default 2 with a tree)",
    "tree_choices": "a static tree: JSON list of top-k rank paths, Medusa's format",
    "regex": "every output fully matches this regex (outlines-core syntax; docs/constraints.md)",
    "json_schema": "every output is JSON valid against the JSON schema in this file",
}


def flag_help(name: str) -> str:
    """A run flag's help: `FLAG_HELP`, and the drafters that read it (from the table of drafters; a
    tree flag no drafter claims: the tree drafters)."""
    if name == "drafter":
        return "; ".join([f"{PLAIN}: plain decoding", *(f"{s.name}: {s.help}" for s in drafters())])
    users = names_where(lambda s: name in s.settings or name in s.needs)
    if not users and KEYS[name].group == "tree":
        users = names_where(lambda s: s.trees)
    return FLAG_HELP[name] + (f" (drafter: {', '.join(users)})" if users else "")


def _gamma(text: str) -> int | str:
    """--gamma, --tree-nodes: an int or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0 or 'auto', got {text!r}") from None


def _token_bias(text: str) -> tuple[int, float]:
    """--logit-bias TOKEN=BIAS: ``(token, bias)``; the bias may be -inf (a ban)."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN=BIAS (e.g. 42=-inf or 7=2.5), got {text!r}") from None


FLAG_TYPES = {"logit_bias": (_token_bias, "TOKEN=BIAS")}  # repeatable flags whose values are not plain ids


def _flag_type(hint) -> type | Callable[[str], int | str]:
    """What parses a flag of a setting annotated ``hint``: int or 'auto', int, float or str."""
    args = typing.get_args(hint) or (hint,)
    if int in args and str in args:
        return _gamma
    return next((kind for kind in (int, float) if kind in args), str)


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per flat config key (`config.KEYS`); every default is None so that only given flags override."""
    for name, key in KEYS.items():
        flag, value, help_text = "--" + name.replace("_", "-"), key.default, flag_help(name)
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        elif isinstance(value, tuple):  # repeatable
            kind = typing.get_args(key.hint)[0] if name not in FLAG_TYPES else FLAG_TYPES[name][0]
            metavar = FLAG_TYPES[name][1] if name in FLAG_TYPES else "ID" if kind is int else None
            parser.add_argument(flag, action="append", type=kind, default=None, help=help_text, metavar=metavar)
        else:
            parser.add_argument(flag, type=_flag_type(key.hint), default=None, help=f"{help_text} (default {value})")
    parser.add_argument("--config", type=pathlib.Path, help="YAML config file (flags override it)")
    parser.add_argument("--json", type=pathlib.Path, metavar="OUT", help="write the full report as JSON")


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """Multi-host start-up (specdec_jax.sharding.initialize_distributed); env JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID stand in for flags left out."""
    parser.add_argument("--coordinator-address", metavar="HOST:PORT", help="process 0's address (multi-host)")
    parser.add_argument("--num-processes", type=int, help="processes taking part (multi-host)")
    parser.add_argument("--process-id", type=int, help="this process's index, 0..N-1 (multi-host)")


def config_from_args(args, defaults: dict | None = None) -> RunConfig:
    """RunConfig of the flags over the --config file over `defaults` (a command's own) over RunConfig's."""
    flags = {name: getattr(args, name) for name in KEYS}
    for name, value in flags.items():  # repeatable flags: lists
        if isinstance(value, list):
            flags[name] = tuple(value)
    file_values = {**(defaults or {}), **(load_yaml(args.config) if args.config else {})}
    return resolve(file_values, flags, where=str(args.config or "flags"))


def _generate(args) -> int:
    from specdec_jax.runner import run, stats_line
    from specdec_jax.sharding import initialize_distributed

    interrupts.keep(lambda: "nothing (the report is written when every prompt is done)")
    distributed = initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    try:
        report = run(config_from_args(args))
    except BaseException:
        if distributed:  # said now: the shutdown barrier below aborts this process while a peer waits in a collective
            traceback.print_exc()
            sys.stderr.flush()
        raise
    finally:
        if distributed:
            # Every process leaves the coordination service at one barrier, before interpreter
            # teardown. Left to atexit, process 0 can take the service down while a peer still
            # polls it, and the peer aborts (SIGABRT) after its work is done.
            jax.distributed.shutdown()
    for r in report["results"]:
        print(f"=== {r['id']} ({r['stop_reason']}, {len(r['tokens'])} tokens)\n{r['text']}\n")
    print(stats_line(report))
    if args.json:
        write_json(args.json, report)
    return 0


def _demo(args) -> int:
    from specdec_jax.demo import PAIR, demo

    cfg = config_from_args(args, defaults=PAIR if args.model in (None, PAIR["model"]) and not args.config else None)
    report = demo(cfg, repeats=args.repeats)
    if args.json:
        write_json(args.json, report)
    return 0


def _bench(args) -> int:
    from specdec_jax.bench import bench, format_report

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.per_category is not None and args.per_category < 1:
        raise ValueError(f"--per-category must be >= 1 prompts, got {args.per_category}")
    finished = 0  # prompt batches in --json so far

    def keep_finished(report: dict) -> None:
        nonlocal finished
        files.write_json(args.json, report)
        finished = len(report["batches"])

    interrupts.keep(lambda: f"{finished} finished prompt batches in {args.json} (\"complete\": false)" if finished
                    else "nothing (no prompt batch had finished)" if args.json
                    else "nothing (--json keeps the finished prompts of a stopped bench)")
    report = bench(config_from_args(args), repeats=args.repeats, per_category=args.per_category, peer=args.peer,
                   on_batch=keep_finished if args.json else None)
    print(format_report(report))
    if args.json:
        write_json(args.json, report)
    return 0


def _sweep(args) -> int:
    from specdec_jax.sweep import finished_points, sweep

    interrupts.keep(lambda: f"{finished_points(args.out)} finished points in {args.out / 'results.jsonl'} (run the "
                    "same command again to resume)")
    records = sweep(args.file, args.out)
    print((args.out / "table.md").read_text(), end="")
    print(f"{len(records)} points in {args.out / 'results.jsonl'}; plots: "
          + ", ".join(sorted(p.name for p in args.out.glob("*.png"))))
    return 0


def _train_draft(args) -> int:
    from specdec_jax.distill.config import FIELDS, train_config
    from specdec_jax.distill.train import latest_checkpoint, train_draft

    interrupts.keep(lambda: latest_checkpoint(args.out))
    tc = train_config(args.config, **{name: getattr(args, name) for name in FIELDS})
    summary = train_draft(tc, args.out, resume=args.resume)
    print(json.dumps(summary, indent=1))
    if "draft" in summary:
        drafter = names_where(lambda s: s.trained_kind == tc.kind)[0]  # the first registered: a built-in one
        print(f"use it with: --drafter {drafter} --draft-model {summary['draft']}")
    return 0


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field (defaults None: only given flags override the file)."""
    from specdec_jax.distill.config import FIELDS
    from specdec_jax.distill.draft import WIDTH_KEYS  # int fields whose default is None (the target's value)

    for name, field in FIELDS.items():
        value = field.default
        if name in WIDTH_KEYS:
            kind = int
        elif isinstance(value, bool):
            kind = _boolean
        elif value is None or isinstance(value, tuple):  # tuples: "3,15,-1", parsed by TrainConfig
            kind = str
        else:
            kind = type(value)
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=f"(default {value})")


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")



SIMULATION_LIMIT = 2**27  # tokens drawn by `theory --simulate` (rounds x (gamma + 1)), a few GB of device arrays


def _theory(args) -> int:
    from specdec_jax.rng import seed_key

    if args.simulate < 0:
        raise ValueError(f"--simulate must be >= 0 rounds, got {args.simulate}")
    if args.simulate * (args.gamma + 1) > SIMULATION_LIMIT:
        raise ValueError(f"--simulate {args.simulate} rounds of gamma {args.gamma} draw {args.simulate * (args.gamma + 1):,} "
                         f"tokens; at most {SIMULATION_LIMIT:,}: fewer rounds or a smaller gamma")
    closed = theory.expected_tokens_per_round(args.alpha, args.gamma)
    print(f"alpha {args.alpha}, gamma {args.gamma}: E[tokens per round] = {closed:.4f} (closed form)")
    if args.simulate:
        import numpy as np

        n_emit = theory.simulate_tokens_per_round(seed_key(args.seed), args.alpha, gamma=args.gamma, rows=args.simulate)
        se = theory.tokens_per_round_std(args.alpha, args.gamma) / np.sqrt(args.simulate)
        print(f"simulated over {args.simulate:,} rounds: {float(np.mean(n_emit)):.4f} +- {se:.4f}")
    return 0


def write_json(path: pathlib.Path, report: dict) -> None:
    files.write_json(path, report)
    print(f"wrote {path}", file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec-jax", description="Speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("demo", help="speculative vs plain decoding side by side: Qwen2.5-Coder 0.5B drafting for "
                       "1.5B (--model smollm2-135m: SmolLM2 with n-gram lookup)")
    add_run_flags(p)
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs of each mode per prompt, medians (default 1 for the Qwen pair, else 3)")
    p.set_defaults(func=_demo)
    p = sub.add_parser("generate", help="generate text for prompts")
    add_run_flags(p)
    add_distributed_flags(p)
    p.set_defaults(func=_generate)
    p = sub.add_parser("bench", help="time plain vs speculative decoding side by side, with the cost model")
    add_run_flags(p)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each mode per batch (medians)")
    p.add_argument("--per-category", type=int, default=None, metavar="N",
                   help="keep the first N prompts of each category of the prompts file")
    p.add_argument("--peer", choices=["hf"], default=None,
                   help="also time transformers greedy and prompt-lookup decoding (needs the hf extra)")
    p.set_defaults(func=_bench)
    p = sub.add_parser("sweep", help="run every point of a grid of configs; results.jsonl, csv, table, plots")
    p.add_argument("file", type=pathlib.Path, help="sweep YAML: base (a config) and grid (key: list of values)")
    p.add_argument("--out", type=pathlib.Path, required=True, help="output folder (resumes what is there)")
    p.set_defaults(func=_sweep)
    p = sub.add_parser("train-draft", help="train a draft model, an EAGLE head or Medusa heads on the target "
                                           "(--kind; optax, orbax checkpoints)")
    p.add_argument("--config", type=pathlib.Path, help="YAML train config (flags override it)")
    p.add_argument("--out", type=pathlib.Path, required=True, help="output folder: data, checkpoints, log, draft/")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    add_train_flags(p)
    p.set_defaults(func=_train_draft)
    p = sub.add_parser("theory", help="closed-form tokens per round for acceptance alpha and gamma drafts")
    p.add_argument("--alpha", type=float, required=True, help="per-position acceptance probability in [0, 1]")
    p.add_argument("--gamma", type=int, required=True, help="drafts per round (>= 0)")
    p.add_argument("--simulate", type=int, default=0, metavar="ROWS", help="also simulate ROWS rounds")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_theory)
    return parser


def main(argv=None, handle_signals: bool = False) -> int:
    """Runs one command; ``handle_signals`` (the console script) routes SIGINT and SIGTERM to a clean stop."""
    args = build_parser().parse_args(argv)
    if handle_signals:
        interrupts.install(args.command)
    try:
        check_outputs(args)
        return args.func(args)
    except KeyboardInterrupt:
        return interrupts.stopped(args.command)
    except jax.errors.JaxRuntimeError:  # a RuntimeError, but the runtime's, not bad input
        raise
    except (ValueError, RuntimeError) as err:
        print(f"specdec-jax: error: {err}", file=sys.stderr)
        return 2


def check_outputs(args) -> None:
    """Refuses an output path that cannot be written before any work starts (`files`)."""
    if getattr(args, "json", None) is not None:
        files.check_output_file(args.json, "--json")
    if getattr(args, "out", None) is not None:
        files.check_output_dir(args.out, "--out")


def console() -> int:
    """The `specdec-jax` script. A command stopped by a signal ends through `interrupts.exit_now`:
    Python's finalization could free jax's client under a compile still running (a segfault)."""
    code = main(handle_signals=True)
    if interrupts.was_stopped():
        interrupts.exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(console())

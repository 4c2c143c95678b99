"""The Qwen2.5-Coder pair: the 0.5B drafting for the 1.5B on held-out Spec-Bench questions.

Makes the entries "How many tokens per round does Qwen2.5-Coder-0.5B give its 1.5B sibling?" and
"Does the same-family pair pay in wall-clock time on this CPU?" of experiments/README.md; writes to
experiments/results/qwen_pair (`--out`):

    python experiments/qwen_pair.py speed        # --gamma auto against plain decoding, side by side (bench; --draft-vocab)
    python experiments/qwen_pair.py acceptance   # tokens per round at gamma 2, 3, 4 per category (after speed)
    python experiments/qwen_pair.py peer         # transformers greedy and assisted generation (after speed)
    python experiments/qwen_pair.py variants     # the coding prompts at gamma 3: float32, --draft-vocab, bfloat16
    python experiments/qwen_pair.py retrieval    # a code datastore beside the 0.5B, and the two combined (after speed)
    python experiments/qwen_pair.py vocab        # greedy tokens per round at gamma 3 per --draft-vocab (after speed)
    python experiments/qwen_pair.py tables       # redraws tables and figures from the saved JSON

Prompts: the held-out split (the 5 highest question ids of each category, never trained on), the
first `--per-category` of each category plus `--extra-coding` more coding questions, of at most
`--max-prompt-tokens` tokens under the chat template (each prompt bucket is another KV capacity to
calibrate and compile for); batch 1, 128 new tokens, float32. `speed` runs `specdec_jax.bench` (plain
and speculative decoding alternate on each prompt; decode-phase medians). `acceptance` replays greedy
speculation at each gamma from bench's plain greedy outputs and one teacher-forced pass of the draft
(exact for greedy; checked against a measured gamma 3 run), and measures temperature 0.7 at gamma 3
(tokens per round is deterministic for a seed and the same on any hardware). `peer` times
transformers (greedy, and assisted generation with the same 0.5B) on the coding prompts of `speed`,
in a process of its own, the same way bench times it. `retrieval` replays, on the same greedy outputs,
prompt lookup, the retrieval drafter over a datastore of this Python's standard library sources
(tokenised with the pair's tokenizer) and the 0.5B, each at gamma 4, and the two combined: the
retrieval chain first, the 0.5B drafting the rest of the 4 (exact for greedy: `specdec_jax.replay`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

from common import (RESULTS, category_bars, draft_matches, gguf_tokenizer, markdown_table, prompts_file, pyplot,
                    recipe_questions, write_json)

from specdec_jax.replay import replay_drafter, replay_greedy

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
GAMMAS = (2, 3, 4)
TEMPERATURES = (0.0, 0.7)


def questions(args, max_prompt_tokens: int | None = None) -> list[dict]:
    """The first `--per-category` held-out questions of each category and `--extra-coding` more coding ones,
    optionally only those of at most `max_prompt_tokens` tokens under the chat template."""
    tokenizer = gguf_tokenizer(DRAFT) if max_prompt_tokens else None
    pick = lambda **kw: recipe_questions("heldout", max_prompt_tokens=max_prompt_tokens,  # noqa: E731
                                         tokenizer=tokenizer, **kw)
    chosen = pick(per_category=args.per_category)
    if args.extra_coding:
        have = {q["question_id"] for q in chosen}
        chosen += [q for q in pick(categories=["coding"]) if q["question_id"] not in have][: args.extra_coding]
    return chosen


def speed_rows(out: pathlib.Path) -> list[tuple]:
    """(id, category, prompt ids, plain greedy output) of every prompt of speed.json."""
    speed = json.loads((out / "speed.json").read_text())
    return [(i, c, p, o) for r in speed["batches"]
            for i, c, p, o in zip(r["ids"], r["categories"], r["prompt_ids"], r["plain_outputs"])]


def run_acceptance(args) -> dict:
    """Tokens per round and acceptance by draft position at each of GAMMAS on the prompts of speed.json.

    Greedy: replayed (`replay_greedy`) from bench's plain greedy outputs and one teacher-forced pass of the
    draft over each prompt and output; checked against a measured gamma 3 run. Temperature 0.7: measured,
    gamma 3 (the prompts as one ragged batch; each row's counts are its solo run's)."""
    import time

    from specdec_jax.drafters import ModelDrafter
    from specdec_jax.engine import generate
    from specdec_jax.models import load_model
    from specdec_jax.sampling import SamplingParams

    rows = speed_rows(args.out)
    replays = []
    for (qid, category, _, output), matches in zip(rows, draft_matches(DRAFT, rows)):
        for gamma in GAMMAS:
            rounds, proposed, accepted = replay_greedy(matches, gamma)
            replays.append({"temperature": 0.0, "gamma": gamma, "id": qid, "category": category, "rounds": rounds,
                            "emitted_tokens": len(output), "proposed": proposed, "accepted": accepted,
                            "agreement": sum(matches) / len(matches), "how": "replayed"})
    target, draft = load_model(TARGET), load_model(DRAFT)
    drafter = ModelDrafter(draft.config, draft.model.params())
    measured = []
    for temperature in TEMPERATURES:
        start = time.perf_counter()
        out = generate(target, [p for _, _, p, _ in rows], drafter, gamma=3,
                       sampling=SamplingParams(temperature=temperature), max_new_tokens=args.max_new_tokens,
                       stop_ids=target.tokenizer.stop_ids, seed=args.seed)
        print(f"measured, temperature {temperature}, gamma 3: {out.metrics.mean_accepted_length:.2f} tokens/round "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        measured += [{"temperature": temperature, "gamma": 3, "id": qid, "category": category, **counts,
                      "tokens": tokens, "how": "measured"}
                     for (qid, category, _, _), counts, tokens in zip(rows, out.row_counts, out.tokens)]
        measured[-1]["per_position_acceptance"] = out.metrics.per_position_acceptance
    return {"target": TARGET, "draft": DRAFT, "seed": args.seed, "replayed": replays, "measured": measured}


def acceptance_tables(payload: dict, out: pathlib.Path) -> str:
    """Per category: the draft's greedy agreement, replayed greedy tokens per round at each gamma, measured
    tokens per round at gamma 3 (greedy: the replay's check; temperature 0.7); acceptance by draft position."""
    replayed, measured = payload["replayed"], payload["measured"]
    categories = list(dict.fromkeys(r["category"] for r in replayed))

    def rate(rows):
        return sum(r["emitted_tokens"] for r in rows) / max(sum(r["rounds"] for r in rows), 1)

    def pick(rows, category, **keys):
        return [r for r in rows if (category == "overall" or r["category"] == category)
                and all(r[k] == v for k, v in keys.items())]

    table_rows, series = [], {f"greedy, gamma {g}": [] for g in GAMMAS}
    series["temperature 0.7, gamma 3 (measured)"] = []
    for c in [*categories, "overall"]:
        agreement = pick(replayed, c, gamma=GAMMAS[0])
        agree = sum(r["agreement"] * r["emitted_tokens"] for r in agreement) / sum(r["emitted_tokens"] for r in agreement)
        greedy = [rate(pick(replayed, c, gamma=g)) for g in GAMMAS]
        sampled = rate(pick(measured, c, temperature=0.7))
        table_rows.append([c, len(agreement), agree, *greedy, rate(pick(measured, c, temperature=0.0)), sampled])
        for g, value in zip(GAMMAS, greedy):
            series[f"greedy, gamma {g}"].append(value)
        series["temperature 0.7, gamma 3 (measured)"].append(sampled)
    table = markdown_table(["category", "prompts", "draft agreement (greedy)"]
                           + [f"tok/round g={g} (greedy, replayed)" for g in GAMMAS]
                           + ["g=3 greedy measured", "g=3 T=0.7 measured"], table_rows)
    positions = []
    for g in GAMMAS:
        rows = pick(replayed, "overall", gamma=g)
        proposed = np.sum([r["proposed"] for r in rows], axis=0)
        accepted = np.sum([r["accepted"] for r in rows], axis=0)
        positions.append([f"greedy g={g} (replayed)", *[a / p for a, p in zip(accepted, proposed)]]
                         + ["-"] * (max(GAMMAS) - g))
    for r in measured:
        if "per_position_acceptance" in r:
            positions.append([f"T={r['temperature']} g=3 (measured)", *r["per_position_acceptance"],
                              *["-"] * (max(GAMMAS) - 3)])
    table += "\nacceptance by draft position (accepted there / rounds that proposed it):\n\n" + markdown_table(
        ["run"] + [f"draft {i}" for i in range(1, max(GAMMAS) + 1)], positions)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(12, 4))
    category_bars(ax, [*categories, "overall"], series, ylabel="tokens per round",
                  title="Qwen2.5-Coder-0.5B drafting for 1.5B: tokens per round (held-out Spec-Bench, 128 new tokens)")
    (out / "acceptance_table.md").write_text(table)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=120)
    plt.close(fig)
    return table


DRAFT_VOCABS = (65536, 32768, 16384, 8192)
VOCAB_SOURCES = ("ids", "sharegpt")  # the first N ids; the N most frequent in ShareGPT (`--draft-vocab-source`)


def run_vocab(args) -> dict:
    """Greedy tokens per round at gamma 3, replayed from bench's plain outputs (speed.json), with the draft's
    logits over all ids, then over each of DRAFT_VOCABS ids ranked by each of VOCAB_SOURCES, per row."""
    rows = speed_rows(args.out)
    replays = []
    for vocab, source in [(0, "ids"), *((v, s) for v in DRAFT_VOCABS for s in VOCAB_SOURCES)]:
        for (qid, category, _, output), matches in zip(rows, draft_matches(DRAFT, rows, vocab, source)):
            rounds, _, _ = replay_greedy(matches, 3)
            replays.append({"draft_vocab": vocab, "vocab_source": source, "id": qid, "category": category,
                            "rounds": rounds, "emitted_tokens": len(output), "agreement": sum(matches) / len(matches)})
    return {"target": TARGET, "draft": DRAFT, "gamma": 3, "replayed": replays}


def vocab_table(payload: dict) -> str:
    """Tokens per round at gamma 3 per category (columns: the draft vocabularies and their sources)."""
    replayed = payload["replayed"]
    categories = [*dict.fromkeys(r["category"] for r in replayed), "overall"]
    kinds = list(dict.fromkeys((r["draft_vocab"], r["vocab_source"]) for r in replayed))

    def rate(category, kind):
        rows = [r for r in replayed if (r["draft_vocab"], r["vocab_source"]) == kind
                and category in ("overall", r["category"])]
        return sum(r["emitted_tokens"] for r in rows) / max(sum(r["rounds"] for r in rows), 1)

    names = [f"{v:,} {'first ids' if s == 'ids' else s}" if v else "all ids" for v, s in kinds]
    return markdown_table(["category", *names], [[c, *(rate(c, k) for k in kinds)] for c in categories])


def run_speed(args) -> dict:
    """`specdec_jax.bench` at `--gamma` (default auto) on the held-out questions of at most `--max-prompt-tokens`
    tokens (each prompt bucket is another KV capacity to calibrate and compile for: longer prompts would add several
    minutes)."""
    from specdec_jax.bench import bench
    from specdec_jax.config import run_config

    with prompts_file(questions(args, args.max_prompt_tokens)) as path:
        cfg = run_config(model=TARGET, drafter="draft-model", draft_model=DRAFT, gamma=args.gamma,
                        draft_vocab=args.draft_vocab, draft_vocab_source=args.draft_vocab_source,
                        draft_confidence=args.draft_confidence,
                        max_new_tokens=args.max_new_tokens, prompts_file=str(path), seed=args.seed)
        return {**bench(cfg, repeats=args.repeats), "draft_vocab": args.draft_vocab}


VARIANTS = ({"dtype": "float32", "draft_vocab": 0}, {"dtype": "float32", "draft_vocab": 32768},
            {"dtype": "bfloat16", "draft_vocab": 32768})


def run_variants(args) -> dict:
    """`specdec_jax.bench` at a fixed gamma 3 on the coding prompts of `speed`, once per setting of VARIANTS (the
    weights' dtype, the draft's output vocabulary): what each does to the draft step, the verify pass and the
    speedup. {"variants": [{"dtype", "draft_vocab", "report"}]}."""
    from specdec_jax.bench import bench
    from specdec_jax.config import run_config
    from specdec_jax.runner import drop_compiled_programs

    coding = [q for q in questions(args, args.max_prompt_tokens) if q["category"] == "coding"]
    saved = args.out / "variants.json"
    out = json.loads(saved.read_text())["variants"] if saved.is_file() else []
    with prompts_file(coding) as path:
        for variant in [VARIANTS[i] for i in args.variants]:
            cfg = run_config(model=TARGET, drafter="draft-model", draft_model=DRAFT, gamma=3, **variant,
                            max_new_tokens=args.max_new_tokens, prompts_file=str(path), seed=args.seed)
            out = [v for v in out if (v["dtype"], v["draft_vocab"]) != (variant["dtype"], variant["draft_vocab"])]
            out.append({**variant, "report": bench(cfg, repeats=args.repeats)})
            write_json(saved, {"variants": out})  # after each: a variant takes 10 (float32) to 50 (bfloat16) minutes
            drop_compiled_programs()
            print(variants_table(out), flush=True)
    return {"variants": out}


def variants_table(variants: list[dict]) -> str:
    """One row per setting: plain and speculative rates, speedup, tokens per round, T1, Tv, Td."""
    rows = []
    for v in variants:
        a = v["report"]["overall"]
        rows.append([v["dtype"], v["draft_vocab"] or "all", a["plain_tokens_per_s"], a["spec_tokens_per_s"],
                     f"{a['speedup']:.2f}x", a["tokens_per_round"], a["T1_ms"], a["Tv_ms"], a["Td_ms"],
                     f"{a['predicted_speedup']:.2f}x"])
    return markdown_table(["dtype", "draft vocab", "plain tok/s", "spec tok/s", "speedup", "tok/round", "T1 ms",
                           "Tv ms (4 tokens)", "Td ms", "predicted"], rows)


def run_peer(args) -> dict:
    """transformers on the coding prompts of speed.json, timed as `bench --peer hf` times it (greedy, and assisted
    generation with the 0.5B), in a process of its own: beside our two float32 models, transformers' two would
    not fit in this machine's 24 GiB. {"rows": [{"id", "greedy": {...}, "assisted": {...}}]}."""
    from specdec_jax.peer_hf import HFPeer
    from specdec_jax.runner import encode

    speed = json.loads((args.out / "speed.json").read_text())
    ids = [i for r in speed["batches"] for i, c in zip(r["ids"], r["categories"]) if c == "coding"][: args.peer_prompts]
    tokenizer = gguf_tokenizer(DRAFT)
    by_id = {q["question_id"]: q for q in recipe_questions("heldout", categories=["coding"])}
    hf = HFPeer(TARGET, DRAFT)
    rows = []
    for qid in ids:
        prompt = encode(tokenizer, by_id[qid]["turns"][0], raw=False)
        row = {"id": qid}
        for mode, assisted in (("greedy", False), ("assisted", True)):
            result = hf.time_decode(prompt, args.max_new_tokens, tokenizer.eos_id, 0, args.repeats, assisted)
            row[mode] = {"decode_tokens": len(result["tokens"]) - 1, "decode_s": result["decode_s"],
                         "tokens_per_s": (len(result["tokens"]) - 1) / result["decode_s"], "tokens": result["tokens"]}
            print(qid, mode, f"{row[mode]['tokens_per_s']:.2f} tok/s", flush=True)
        rows.append(row)
    return {"rows": rows}


def peer_table(speed: dict, peer: dict, out: pathlib.Path) -> str:
    """Per coding prompt: our plain and speculative decode rates (speed.json) beside transformers' (peer.json)."""
    ours = {i: r for r in speed["batches"] for i in r["ids"]}
    rows = []
    for r in peer["rows"]:
        o = ours[r["id"]]
        rows.append([r["id"], o["plain_tokens_per_s"], o["spec_tokens_per_s"], r["greedy"]["tokens_per_s"],
                     r["assisted"]["tokens_per_s"], o["spec_tokens_per_s"] / r["assisted"]["tokens_per_s"]])
    table = markdown_table(["question", "ours plain tok/s", "ours spec (auto) tok/s", "hf greedy tok/s",
                            "hf assisted tok/s", "ours spec / hf assisted"], rows)
    (out / "peer_table.md").write_text(table)
    return table


def stdlib_source() -> pathlib.Path:
    """A JSONL of this Python's standard library sources (every .py file, site-packages and the test
    suite left out), written once into the cache: a code datastore found on any machine."""
    import sysconfig

    from specdec_jax import cache
    from specdec_jax.cache import cache_dir

    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    path = cache_dir() / "sources" / f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib.jsonl"

    def build(tmp: pathlib.Path) -> pathlib.Path:
        files = sorted(f for f in stdlib.rglob("*.py") if not {"site-packages", "test", "__pycache__"} &
                       set(f.relative_to(stdlib).parts))
        tmp.write_text("".join(json.dumps({"text": f.read_text(errors="replace")}) + "\n" for f in files))
        return path

    return cache.entry(path, "the standard library's sources", lambda found: found, build)


def run_retrieval(args) -> dict:
    """Tokens per round at gamma 4 on speed.json's greedy outputs: prompt lookup, the retrieval drafter
    over the standard library's sources, the 0.5B, the retrieval chain then the 0.5B (`replay.replay_drafter`)."""
    from specdec_jax.datastore import load_datastore
    from specdec_jax.drafters import NgramDrafter, RetrievalDrafter

    rows = speed_rows(args.out)
    store = load_datastore([str(stdlib_source())], gguf_tokenizer(DRAFT))
    lookup = NgramDrafter(max_n=3, min_n=1)
    retrieval = RetrievalDrafter.from_datastore(store, lookup=lookup)
    matches = draft_matches(DRAFT, rows)
    pairs = [(p, o) for _, _, p, o in rows]
    runs = {"prompt lookup": replay_drafter(lookup, pairs, 4),
            "retrieval (stdlib)": replay_drafter(retrieval, pairs, 4),
            "0.5B": replay_drafter(None, pairs, 4, matches),
            "retrieval (stdlib), then the 0.5B": replay_drafter(retrieval, pairs, 4, matches)}
    return {"datastore": {**store.meta, "MiB": store.nbytes / 2**20}, "gamma": 4,
            "rows": [{"id": i, "category": c} for i, c, _, _ in rows], "runs": runs,
            "costs": replay_costs(json.loads((args.out / "speed.json").read_text()))}


def replay_costs(speed: dict) -> dict:
    """Seconds the retrieval table predicts with, kept in retrieval.json (a later speed run leaves its table as
    it was): speed.json's median T1, Tv (5 tokens) and Td (one 0.5B step)."""
    tv = np.median([b["T_by_width"][b["verify_widths"].index(5)] if 5 in b["verify_widths"] else b["Tv"]
                    for b in speed["batches"]])
    return {"T1": float(np.median([b["T1"] for b in speed["batches"]])), "Tv": float(tv),
            "Td": float(np.median([b["Td"] for b in speed["batches"]]))}


def retrieval_table(payload: dict) -> str:
    """Markdown: tokens per round per category and overall, the 0.5B's drafts per round, and the speedup
    the cost model predicts from the costs of the speed run it replayed (`replay_costs`)."""
    costs = payload["costs"]
    ds = payload["datastore"]
    lines = [f"Datastore: Python standard library sources, {ds['documents']:,} files, {ds['tokens']:,} tokens "
             f"(Qwen tokenizer), {ds['MiB']:.0f} MiB, built in {ds['build_s']} s. Gamma 4, greedy, replayed on "
             f"speed.json's outputs; predicted speedup = tokens per round x T1 / (Tv + 0.5B drafts per round x Td), "
             f"T1 {1000 * costs['T1']:.0f} ms, Tv {1000 * costs['Tv']:.0f} ms, Td {1000 * costs['Td']:.0f} ms "
             "(medians of the speed run replayed).",
             "",
             "| drafter | " + " | ".join(sorted({r["category"] for r in payload["rows"]})) +
             " | overall | 0.5B drafts per round | predicted speedup |", "|---|" + "---|" * 
             (len({r["category"] for r in payload["rows"]}) + 3)]
    categories = sorted({r["category"] for r in payload["rows"]})
    for name, stats in payload["runs"].items():
        def rate(keep):
            chosen = [s for s, r in zip(stats, payload["rows"]) if keep(r)]
            return sum(s["emitted_tokens"] for s in chosen) / sum(s["rounds"] for s in chosen)
        rounds = sum(s["rounds"] for s in stats)
        model = sum(s["model_drafts"] for s in stats) / rounds
        overall = rate(lambda r: True)
        lines.append(f"| {name} | " + " | ".join(f"{rate(lambda r, c=c: r['category'] == c):.2f}" for c in categories)
                     + f" | {overall:.2f} | {model:.2f} | "
                     f"{overall * costs['T1'] / (costs['Tv'] + model * costs['Td']):.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["acceptance", "speed", "peer", "variants", "retrieval", "vocab", "tables"])
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--extra-coding", type=int, default=3, help="more held-out coding questions")
    parser.add_argument("--peer-prompts", type=int, default=3, help="coding questions timed beside transformers")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=128, help="speed: longer prompts are left out")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per prompt (medians)")
    parser.add_argument("--variants", type=int, nargs="+", default=list(range(len(VARIANTS))),
                        help="variants: indices into VARIANTS (kept results of the others are kept)")
    parser.add_argument("--draft-vocab", type=int, default=32768, help="speed: the draft's output ids (0: all)")
    parser.add_argument("--draft-vocab-source", default="sharegpt", help="speed: which ids --draft-vocab keeps")
    parser.add_argument("--draft-confidence", type=float, default=0.0,
                        help="speed: chains stop after a draft of confidence below this (0: never)")
    parser.add_argument("--gamma", type=lambda v: v if v == "auto" else int(v), default="auto",
                        help="speed: drafts per round, or auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "qwen_pair")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "acceptance":
        write_json(args.out / "acceptance.json", run_acceptance(args))
    elif args.stage == "speed":
        from specdec_jax.bench import format_report

        report = run_speed(args)
        write_json(args.out / "speed.json", report)
        (args.out / "speed_table.md").write_text(format_report(report) + "\n")
        print(format_report(report))
    elif args.stage == "peer":
        write_json(args.out / "peer.json", run_peer(args))
    elif args.stage == "variants":
        run_variants(args)
    elif args.stage == "retrieval":
        write_json(args.out / "retrieval.json", run_retrieval(args))
    elif args.stage == "vocab":
        write_json(args.out / "vocab.json", run_vocab(args))
    if (args.out / "vocab.json").is_file():
        table = vocab_table(json.loads((args.out / "vocab.json").read_text()))
        (args.out / "vocab_table.md").write_text(table)
        print(table)
    if (args.out / "retrieval.json").is_file():
        table = retrieval_table(json.loads((args.out / "retrieval.json").read_text()))
        (args.out / "retrieval_table.md").write_text(table)
        print(table)
    if (args.out / "variants.json").is_file():
        table = variants_table(json.loads((args.out / "variants.json").read_text())["variants"])
        (args.out / "variants_table.md").write_text(table + "\n")
        print(table)
    if (args.out / "acceptance.json").is_file():
        print(acceptance_tables(json.loads((args.out / "acceptance.json").read_text()), args.out))
    if (args.out / "peer.json").is_file() and (args.out / "speed.json").is_file():
        print(peer_table(json.loads((args.out / "speed.json").read_text()),
                         json.loads((args.out / "peer.json").read_text()), args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

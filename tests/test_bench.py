"""specdec-jax bench on tiny-random: report structure, cost-model arithmetic, equality, errors.

The cost terms are replaced by known constants (T(1), T(5), one draft step), and
the round counts the report uses are checked against an independent replay: the
plain output (which speculative greedy decoding must reproduce) walked round by
round with the plain-Python n-gram proposal of docs/design.md section 5. Every predicted
time and speedup is then a number computed here, from scratch.
"""

import json
import math
import threading

import pytest

import engine_helpers as H
from specdec_jax import bench as bench_module
from specdec_jax import interrupts
from specdec_jax import engine
from specdec_jax.bench import _subsample, bench, format_report
from specdec_jax.cli import main
from specdec_jax.config import run_config
from specdec_jax.models import load_model
from specdec_jax.runner import encode

T_BY_WIDTH = {1: 0.010, 5: 0.025}  # seconds of a target pass at each verify width
DRAFT_STEP = 0.004  # seconds of one draft_step (gamma 4 drafts: Td = 1 ms)
NEW = 12


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    lines = [
        {"question_id": 1, "category": "copy", "turns": ["abc abc abc abc abc abc"]},
        {"question_id": 2, "category": "copy", "turns": ["xyz xyz xyz xyz"]},
        {"question_id": 3, "category": "open", "turns": ["tell me"]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    cfg = run_config(model="tiny-random", raw=True, ignore_eos=True, prompts_file=str(path), max_new_tokens=NEW,
                    gamma=4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_module, "time_target_pass", lambda run, width: T_BY_WIDTH[width])
        patch.setattr(bench_module, "time_draft_step", lambda run: DRAFT_STEP)
        return bench(cfg, repeats=1, per_category=1, progress=False)


def replay(prompt: list[int], output: list[int], gamma: int = 4) -> dict:
    """Rounds of greedy n-gram speculative decoding that reproduce `output`, counted in Python:
    drafts from `H.reference_ngram` (the config's max_n 3, min_n 2), clipped to the budget."""
    history, emitted = list(prompt), 0
    rounds = wide = drafted = accepted = 0
    while emitted < len(output):
        room = len(output) - emitted - 1
        drafts = H.reference_ngram(history, gamma, max_n=3, min_n=2)[:room]
        hits = 0
        while hits < len(drafts) and drafts[hits] == output[emitted + hits]:
            hits += 1
        rounds, wide, drafted, accepted = rounds + 1, wide + bool(drafts), drafted + len(drafts), accepted + hits
        history += output[emitted : emitted + hits + 1]
        emitted += hits + 1
    return dict(rounds=rounds, width_rounds=[rounds - wide, wide], drafted=drafted, accepted=accepted)


def test_report_has_categories_and_cost_model(report):
    assert set(report["categories"]) == {"copy", "open"}  # per_category=1 keeps question 1 and 3
    assert report["overall"]["prompts"] == 2
    target = load_model("tiny-random")
    for batch, text in zip(report["batches"], ["abc abc abc abc abc abc", "tell me"]):
        assert batch["plain_tokens"] == batch["spec_tokens"] == NEW  # decode phase: the loop emits every token
        for mode in ("plain", "spec"):  # the loop's own seconds, timed inside each run; prefill is the rest
            assert 0 < batch[f"{mode}_s"] < batch["end_to_end_s"][mode]
            assert batch["prefill_s"][mode] > 0
        assert batch["tie_aware_equal"] == [True] and batch["exact_equal"] == [True]
        prompt = encode(target.tokenizer, text, raw=True)
        plain = engine.generate(target, [prompt], max_new_tokens=NEW, logprobs=0)  # plain decoding
        output = plain.tokens[0]
        # the outputs' teacher-forced log-probability, against the one the plain run recorded
        assert batch["logprob_sum"]["plain"] == pytest.approx(float(plain.logprobs[0].sum()), abs=1e-3)
        assert batch["logprob_sum"]["spec"] == pytest.approx(batch["logprob_sum"]["plain"], abs=1e-4)
        counts = replay(prompt, output)
        rounds = counts["rounds"]
        assert batch["loop_rounds"] == {"plain": NEW, "spec": rounds}
        assert batch["width_rounds"] == counts["width_rounds"]
        assert (batch["draft_tokens"], batch["accepted_tokens"]) == (counts["drafted"], counts["accepted"])
        assert batch["tokens_per_round"] == pytest.approx(NEW / rounds)
        assert (batch["T1"], batch["Tv"], batch["Td"]) == (0.010, 0.025, DRAFT_STEP / 4)
        assert batch["verify_widths"] == [1, 5] and batch["T_by_width"] == [0.010, 0.025]
        narrow, wide = counts["width_rounds"]
        spec_s = 0.010 * narrow + 0.025 * wide + DRAFT_STEP * rounds
        assert batch["predicted_s"] == pytest.approx({"plain": NEW * 0.010, "spec": spec_s})
        assert batch["predicted_speedup"] == pytest.approx(NEW * 0.010 / spec_s)
        assert batch["speedup"] == pytest.approx(batch["plain_s"] / batch["spec_s"])
    assert report["batches"][0]["width_rounds"][1] > 0  # the copy prompt drafted
    mean = report["overall"]["mean_logprob"]
    assert mean["plain"] < 0 and mean["spec"] == pytest.approx(mean["plain"], abs=1e-6)
    assert report["memory_bandwidth_gb_s"] > 0.1
    assert 0 < report["plain_fraction_of_bandwidth_floor"]


def test_cost_model_times_each_piece_with_donated_caches():
    """The real timers run the engine's pieces (target pass at each verify width, draft step) with
    their caches donated and fed back; each gives a positive time."""
    cfg = run_config(model="tiny-random", raw=True, ignore_eos=True, max_new_tokens=NEW)
    costs = bench_module.cost_model(H.target(), H.ngram(), 4, [H.RAGGED[2]], 64, cfg)
    assert costs["verify_widths"] == [1, 5] and all(t > 0 for t in costs["T_by_width"]) and costs["Td"] > 0
    assert (costs["T1"], costs["Tv"]) == tuple(costs["T_by_width"])


def test_auto_cost_model_charges_each_width_its_own_drafting(tmp_path, monkeypatch):
    """gamma auto: the calibration the run decided with (read from its cache, not measured again),
    one verify and one drafting cost per verify width."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    engine.generate(H.target(), [H.RAGGED[2]], H.ngram(), gamma="auto", max_new_tokens=NEW, capacity=64)

    def measured_again(*args, **kwargs):
        raise AssertionError("the bench measured the costs again instead of reading the run's calibration")

    monkeypatch.setattr(engine.calibration, "measure_costs", measured_again)
    calibrated = engine.calibrated_costs

    def slowed(*args, **kwargs):  # the calibration's seconds, 1000 times longer
        costs = calibrated(*args, **kwargs)
        scale = lambda v: [1000 * x for x in v] if isinstance(v, list) else 1000 * v
        return {k: scale(v) if k in ("T1", "verify_s", "draft_s") else v for k, v in costs.items()}

    monkeypatch.setattr(engine, "calibrated_costs", slowed)
    cfg = run_config(model="tiny-random", raw=True, ignore_eos=True, max_new_tokens=NEW)
    costs = bench_module.cost_model(H.target(), H.ngram(), "auto", [H.RAGGED[2]], 64, cfg)
    assert costs["verify_widths"] == [1, 2, 3, 4, 5] and len(costs["T_by_width"]) == len(costs["D_by_width"]) == 5
    assert all(t > 0 for t in costs["T_by_width"])
    # T1 is plain decoding's own step, timed now, not the policy's round that drafts nothing
    assert 0 < costs["T1"] < costs["T_by_width"][0] / 10
    assert costs["Tv"] == costs["T_by_width"][-1] and costs["Td"] == pytest.approx(costs["D_by_width"][-1] / 4)


def test_format_report_lists_every_category(report):
    text = format_report(report)
    for name in ("copy", "open", "**overall**", "memory bandwidth", "acceptance by draft position"):
        assert name in text


def test_subsample_keeps_first_n_per_category():
    records = [{"id": i, "category": c} for i, c in enumerate("aabab")]
    assert [r["id"] for r in _subsample(records, 1)] == [0, 2]
    assert _subsample(records, None) == records


def test_bench_without_a_drafter_is_a_clean_error(capsys):
    assert main(["bench", "--model", "tiny-random", "--drafter", "none", "--prompt", "x"]) == 2
    assert "bench compares a drafter" in capsys.readouterr().err


def test_a_stopped_bench_keeps_its_finished_prompts_in_its_json(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the second of three prompts: --json holds the first prompt's batch, marked incomplete,
    and the stop's one line says so; an uninterrupted run marks its report complete."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [t]})
                                 for i, t in enumerate(["abc abc abc", "xyz xyz", "tell me"])))
    monkeypatch.setattr(bench_module, "time_target_pass", lambda run, width: T_BY_WIDTH[width])
    monkeypatch.setattr(bench_module, "time_draft_step", lambda run: DRAFT_STEP)
    monkeypatch.setattr(interrupts, "_finished", threading.Event())  # this process may have printed a stop before
    compare_rows = bench_module.compare_rows
    calls = []

    def stop_in_the_second_batch(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return compare_rows(*args)

    monkeypatch.setattr(bench_module, "compare_rows", stop_in_the_second_batch)
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "tiny-random", "--raw", "--ignore-eos", "--max-new-tokens", "4", "--gamma", "4",
            "--repeats", "1", "--prompts-file", str(prompts), "--json", str(out)]
    assert main(argv) == 130
    kept = json.loads(out.read_text())
    assert kept["complete"] is False and [b["ids"] for b in kept["batches"]] == [[0]]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f'specdec-jax: bench stopped by SIGINT; kept: 1 finished prompt batches in {out} ("complete": false)')
    monkeypatch.setattr(bench_module, "compare_rows", compare_rows)
    assert main(argv) == 0
    full = json.loads(out.read_text())
    assert full["complete"] is True and [b["ids"] for b in full["batches"]] == [[0], [1], [2]]


TREE_DRAFTERS = {"ngram": lambda tmp: {}, "draft-model": lambda tmp: {"draft_model": "tiny-random-draft"},
                 "eagle": lambda tmp: {"draft_model": H.random_head("eagle", tmp / "eagle")},
                 "medusa": lambda tmp: {"draft_model": H.random_head("medusa", tmp / "medusa")}}


@pytest.mark.parametrize("drafter", [pytest.param(d, marks=pytest.mark.slow) if d in ("draft-model", "medusa") else d
                                     for d in TREE_DRAFTERS])  # CI time; both trees also run in test_sweep's smoke runs
def test_bench_of_a_tree_reports_depths_and_nodes(drafter, tmp_path):
    """A tree of 6 nodes, depth 3, top-2 from each tree drafter: the report's accepted-depth counts
    cover every round and match the per-depth counts, acceptance is by depth (no position past the
    tree's depth is proposed), nodes per round are the drafts per round, and output equals plain."""
    cfg = run_config(model="tiny-random", raw=True, ignore_eos=True, prompt=("abc abc abc abc abc abc",),
                    max_new_tokens=NEW, tree_depth=3, tree_topk=2, drafter=drafter, **TREE_DRAFTERS[drafter](tmp_path))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_module, "time_target_pass", lambda run, width: {1: 0.010, 7: 0.030}[width])
        patch.setattr(bench_module, "time_draft_step", lambda run: DRAFT_STEP)
        report = bench(cfg, repeats=1, progress=False)
    overall, batch = report["overall"], report["batches"][0]
    depths = overall["accepted_depth_rounds"]
    assert len(depths) == 7 and sum(depths) == batch["rounds"]
    assert [sum(depths[i + 1:]) for i in range(6)] == batch["position_accepted"]
    proposed = batch["position_proposed"]
    assert proposed[0] > 0 and proposed[3:] == [0, 0, 0] and proposed[0] >= proposed[1] >= proposed[2]
    rates = overall["per_position_acceptance"]
    assert all(0 <= r <= 1 for r in rates[:3]) and all(math.isnan(r) for r in rates[3:])
    assert overall["drafts_per_round"] == pytest.approx(batch["draft_tokens"] / batch["rounds"])
    assert overall["verify_widths"] == [1, 7] and overall["tie_aware_equal"]
    assert "tree=6 nodes, depth 3, top-2" in format_report(report).splitlines()[0]


def test_bench_under_a_regex_compares_constrained_runs():
    """--regex reaches both of bench's runs (its compile run too: a budget the shortest match fits)."""
    cfg = run_config(model="tiny-random", raw=True, prompt=("abc abc abc",), max_new_tokens=16, gamma=4,
                    regex=r"[a-c]{2,4}( [a-c]{2,4})+")
    report = bench(cfg, repeats=1, progress=False)
    row = report["batches"][0]
    assert row["exact_equal"] == [True] and row["plain_tokens"] == row["spec_tokens"] >= 5

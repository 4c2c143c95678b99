"""specdec-jax bench on tiny-random: report structure, cost-model arithmetic, equality, errors."""

import json

import pytest

from specdec_jax.bench import _subsample, bench, format_report
from specdec_jax.cli import main
from specdec_jax.config import RunConfig


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    lines = [
        {"question_id": 1, "category": "copy", "turns": ["abc abc abc abc abc abc"]},
        {"question_id": 2, "category": "copy", "turns": ["xyz xyz xyz xyz"]},
        {"question_id": 3, "category": "open", "turns": ["tell me"]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    cfg = RunConfig(model="tiny-random", raw=True, ignore_eos=True, prompts_file=str(path), max_new_tokens=12)
    return bench(cfg, repeats=1, per_category=1, progress=False)


def test_report_has_categories_and_cost_model(report):
    assert set(report["categories"]) == {"copy", "open"}  # per_category=1 keeps question 1 and 3
    assert report["overall"]["prompts"] == 2
    for batch in report["batches"]:
        assert batch["plain_tokens"] == batch["spec_tokens"] == 11  # decode phase: the first token is prefill's
        assert batch["T1"] > 0 and batch["Tv"] > 0 and batch["Td"] > 0
        gamma = report["config"]["gamma"]
        # The cost model: each round costs the target pass at the width it ran, plus gamma draft steps.
        assert batch["verify_widths"] == [1, 5] and len(batch["T_by_width"]) == 2
        assert batch["T_by_width"][0] == batch["T1"] and batch["T_by_width"][-1] == batch["Tv"]
        rounds = batch["loop_rounds"]["spec"]
        assert sum(batch["width_rounds"]) == rounds and batch["loop_rounds"]["plain"] == 12
        spec_s = sum(n * t for n, t in zip(batch["width_rounds"], batch["T_by_width"])) + rounds * gamma * batch["Td"]
        plain_s = 12 * batch["T1"]
        assert batch["predicted_s"] == pytest.approx({"plain": plain_s, "spec": spec_s})
        assert batch["predicted_speedup"] == pytest.approx((batch["emitted_tokens"] / spec_s) / (12 / plain_s))
        assert batch["speedup"] == pytest.approx(batch["plain_s"] / batch["spec_s"])
        assert batch["tie_aware_equal"] == [True]
    assert report["memory_bandwidth_gb_s"] > 0.1
    assert 0 < report["plain_fraction_of_bandwidth_floor"]


def test_format_report_lists_every_category(report):
    text = format_report(report)
    for name in ("copy", "open", "**overall**", "memory bandwidth", "per-position acceptance"):
        assert name in text


def test_subsample_keeps_first_n_per_category():
    records = [{"id": i, "category": c} for i, c in enumerate("aabab")]
    assert [r["id"] for r in _subsample(records, 1)] == [0, 2]
    assert _subsample(records, None) == records


def test_bench_without_a_drafter_is_a_clean_error(capsys):
    assert main(["bench", "--model", "tiny-random", "--drafter", "none", "--prompt", "x"]) == 2
    assert "bench compares a drafter" in capsys.readouterr().err

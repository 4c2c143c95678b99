"""The accelerator check (`experiments/accelerator_check.py`, run by scripts/accelerator_check.sh) on CPU
with tiny shapes (`--dry-run`): every measurement runs and lands in the report, and the time budget
skips what does not fit and says so."""

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "accelerator_check.py"


def check(out: pathlib.Path, *flags: str) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--repeats", "2", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_the_dry_run_measures_every_part_of_the_report(tmp_path):
    [shape] = check(tmp_path)["shapes"]
    assert shape["skipped"] == []
    assert sorted(map(int, shape["Tv_over_T1"])) == [1, 2, 4, 8, 16, 32] and shape["Tv_over_T1"]["1"] == 1.0
    assert shape["T1_ms"] > 0 and shape["floor_ms"] > 0 and shape["T1_over_floor"] > 0
    assert sorted(map(int, shape["batches"])) == [8, 32, 64]
    assert all(b["plain_tokens_per_s"] > 0 for b in shape["batches"].values())
    assert sorted(map(int, shape["rounds"])) == list(range(1, 9))
    for gamma, row in shape["rounds"].items():  # a round never costs less than a plain round's share of it
        assert row["round_over_T1"] > 0.5 and row["speedup_alpha_0.8"] > row["speedup_alpha_0.6"] > 0
    assert shape["tree16_round_over_T1"] > 0 and "round_overhead_ms" in shape
    table = (tmp_path / "table.md").read_text()
    assert "Tv(32)/T1" in table and "tree 16" in table


@pytest.mark.slow
def test_a_spent_budget_skips_the_rest_and_lists_it(tmp_path):
    [shape] = check(tmp_path, "--budget-s", "0")["shapes"]
    assert shape["skipped"][0] == "Tv(1)" and shape["skipped"][-1] == "tree 16" and "T1_ms" not in shape

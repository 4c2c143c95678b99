"""The table of drafters: a drafter defined outside the package, added with one `register_drafter` call,
runs everywhere a built-in one does (config checks, CLI help, `engine.generate`, bench, sweeps) without
any package file naming it; registration is undone after each test."""

import contextlib
import dataclasses
import json

import jax.numpy as jnp
import pytest

import engine_helpers as H
from specdec_jax import bench as bench_module
from specdec_jax import cli, engine
from specdec_jax.config import run_config
from specdec_jax.drafters.base import DrafterBase, Proposal
from specdec_jax.drafters.table import drafter_names, drafter_spec, register_drafter, unregister_drafter
from specdec_jax.runner import build_drafter
from specdec_jax.sweep import sweep

NAME = "repeat-last"
HELP = "proposes the newest committed token again (a test drafter)"


@dataclasses.dataclass(frozen=True)
class RepeatLast(DrafterBase):
    """Proposes t0, the newest committed token, gamma times (point masses): docs/design.md section 9's example."""

    name: str = NAME
    params: None = dataclasses.field(default=None, compare=False)

    def init(self, params, prefill):
        return None

    def propose(self, params, state, ctx, gamma):
        t0 = jnp.take_along_axis(ctx.tokens, ctx.num_tokens[:, None] - 1, axis=1)  # i32[B,1]
        drafts = jnp.broadcast_to(t0, (t0.shape[0], gamma)).astype(jnp.int32)  # i32[B,gamma]
        return Proposal(drafts, jnp.full((t0.shape[0],), gamma, jnp.int32), None), state


@contextlib.contextmanager
def registered():
    """``--drafter repeat-last`` while the block runs."""
    register_drafter(NAME, lambda cfg, target, mesh: RepeatLast(), HELP)
    try:
        yield
    finally:
        unregister_drafter(NAME)


@pytest.fixture
def repeat_last():
    with registered():
        yield


def test_a_registered_drafter_is_in_the_table_the_checks_and_the_help_until_unregistered():
    with pytest.raises(ValueError, match=rf"drafter must be one of none, ngram, .*, got '{NAME}'"):
        run_config(drafter=NAME)
    with registered():
        assert drafter_names()[-1] == NAME and drafter_spec(NAME).help == HELP
        cfg = run_config(drafter=NAME, gamma=2)
        assert isinstance(build_drafter(cfg, target=None), RepeatLast)
        assert f"{NAME}: {HELP}" in cli.flag_help("drafter")
        with pytest.raises(ValueError, match=rf"the {NAME} drafter drafts chains only; token trees \(tree_\*\) come "
                                             "from ngram, retrieval, draft-model, eagle, medusa"):
            run_config(drafter=NAME, tree_depth=3)
        with pytest.raises(ValueError, match=rf"datastore is for drafter 'retrieval', not '{NAME}'"):
            run_config(drafter=NAME, datastore=["sharegpt"])
        with pytest.raises(ValueError, match=f"drafter '{NAME}' is taken"):
            register_drafter(NAME, lambda cfg, target, mesh: RepeatLast(), HELP)
    assert NAME not in drafter_names() and NAME not in cli.flag_help("drafter")
    with pytest.raises(ValueError, match=f"unknown drafter '{NAME}'"):
        drafter_spec(NAME)


def test_a_registered_drafter_decodes_as_plain_decoding_does(repeat_last):
    """Greedy: the same tokens as plain decoding, through the engine's generate."""
    drafter = build_drafter(run_config(drafter=NAME, gamma=H.GAMMA), H.target())
    out = engine.generate(H.target(), H.RAGGED, drafter, gamma=H.GAMMA, max_new_tokens=H.MAX_NEW)
    assert out.tokens == H.reference_no_eos().tokens
    assert out.metrics.draft_tokens > 0 and out.metrics.rounds < sum(map(len, out.tokens))


def test_bench_reports_a_registered_drafter(repeat_last, monkeypatch):
    """bench's rows for the drafter, its transformers peer the table's default (prompt lookup)."""
    monkeypatch.setattr(bench_module, "time_target_pass", lambda run, width: {1: 0.010, 5: 0.025}[width])
    monkeypatch.setattr(bench_module, "time_draft_step", lambda run: 0.004)
    cfg = run_config(model="tiny-random", raw=True, ignore_eos=True, prompt=("abc abc abc",), max_new_tokens=12,
                     gamma=4, drafter=NAME)
    report = bench_module.bench(cfg, repeats=1, progress=False)
    [row] = report["batches"]
    assert report["config"]["drafter"] == NAME and bench_module.peer_mode(cfg) == "lookup"
    assert row["exact_equal"] == [True] and row["plain_tokens"] == row["spec_tokens"] == 12
    assert row["draft_tokens"] > 0 and report["overall"]["tokens_per_round"] >= 1
    assert f"drafter {NAME}" in bench_module.format_report(report).splitlines()[0]


def test_a_sweep_over_drafters_runs_a_registered_one(repeat_last, tmp_path):
    """A grid over `none` and the registered drafter: greedy, so both points emit the same tokens."""
    path = tmp_path / "sweep.yaml"
    path.write_text("base: {model: tiny-random, gamma: 2, max_new_tokens: 6, ignore_eos: true, raw: true, "
                    "batch_size: 2, prompt: [ab, cde]}\n"
                    f"grid: {{drafter: [none, {NAME}]}}\n")
    plain, spec = sweep(path, tmp_path / "out", progress=False)
    assert (plain["config"]["gamma"], spec["config"]["gamma"]) == (0, 2)
    assert [r["point"]["drafter"] for r in (plain, spec)] == ["none", NAME]
    assert spec["outputs_sha256"] == plain["outputs_sha256"] and spec["metrics"]["draft_tokens"] > 0
    lines = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["config"]["drafter"] for r in lines] == ["none", NAME]

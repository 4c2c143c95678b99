"""Configs and sweeps: flat keys and flags build the nested config, every file in configs/ runs, sweeps write
their record and resume, reruns repeat."""

import csv
import itertools
import json
import pathlib

import jax
import pytest

import engine_helpers as H
from specdec_jax import cli, runner
from specdec_jax.cli import main
from specdec_jax.config import ConstraintSettings, DrafterSettings, Inputs, TreeSettings, load_yaml, resolve, run_config
from specdec_jax.sampling import SamplingParams
from specdec_jax.sweep import load_sweep, sweep
from specdec_jax.token_tree import load_choices

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if p.parent.name != "train")  # train configs: test_distill
SMOKE = {"model": "tiny-random", "max_new_tokens": 3, "batch_size": 2, "prompt": ("hi", "abcabc"),
         "prompts_file": None, "raw": True, "ignore_eos": True}


def smoke(cfg, tmp_path):
    """The config on tiny-random with a tiny budget (draft models become tiny-random-draft, EAGLE and
    Medusa heads random heads for tiny-random, a retrieval datastore a folder of one small file)."""
    changes = dict(SMOKE)
    if cfg.drafting.datastore:
        (tmp_path / "docs").mkdir()
        (tmp_path / "docs" / "notes.txt").write_text("hi there, abcabc again")
        changes["datastore"] = (str(tmp_path / "docs"),)
    if cfg.drafter in ("eagle", "medusa"):
        changes["draft_model"] = H.random_head(cfg.drafter, tmp_path / "head")
    elif cfg.draft_model:
        changes["draft_model"] = "tiny-random-draft"
    return cfg.updated(**changes)


# Smoke-run in the default suite (one of each kind: a model, a drafter, a tree sweep, a datastore); the others
# in the slow step (suite time).
SMOKE_RUN_BY_DEFAULT = {"models/tiny-random.yaml", "drafters/ngram.yaml", "drafters/retrieval.yaml",
                        "sweeps/eagle_tree.yaml"}


def config_of(path: pathlib.Path):
    """The run config of a config file (a sweep file's last grid point)."""
    if "grid" in load_raw(path):
        keys, configs = load_sweep(path)
        assert keys and configs
        return configs[-1]
    return resolve(load_yaml(path), {}, where=str(path))


def test_every_config_file_loads():
    assert len(CONFIGS) > len(SMOKE_RUN_BY_DEFAULT)
    assert SMOKE_RUN_BY_DEFAULT <= {str(p.relative_to(CONFIG_DIR)) for p in CONFIGS}
    for path in CONFIGS:
        assert config_of(path).drafter


@pytest.mark.parametrize("path", [p if str(p.relative_to(CONFIG_DIR)) in SMOKE_RUN_BY_DEFAULT
                                  else pytest.param(p, marks=pytest.mark.slow) for p in CONFIGS],
                         ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_config_file_smoke_runs_on_tiny_random(path, tmp_path, monkeypatch):
    cfg = config_of(path)
    if cfg.drafting.datastore:
        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # the folder's index
    report = runner.run(smoke(cfg, tmp_path), progress=False)
    assert [len(r["tokens"]) for r in report["results"]] == [3, 3]
    assert report["config"]["drafter"] == cfg.drafter and report["config"]["gamma"] == cfg.gamma


FLAT = {"model": "tiny-random", "dtype": "bfloat16", "drafter": "draft-model", "draft_model": "tiny-random-draft",
        "gamma": 3, "seed": 5, "mesh": "data=1", "temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.125,
        "repetition_penalty": 1.25, "presence_penalty": 0.5, "frequency_penalty": -0.25, "prompt": ["a", "b c"],
        "prompts_file": "p.jsonl", "raw": True, "batch_size": 2, "max_new_tokens": 9, "ignore_eos": True,
        "stop_id": [3, 0], "draft_vocab": 100, "draft_vocab_source": "texts.jsonl", "oracle_alpha": 0.5, "ngram_max": 4, "ngram_min": 1,
        "regex": "a+"}
TREE_FLAT = {"drafter": "retrieval", "datastore": ["sharegpt", "outputs"], "tree_nodes": 5, "tree_depth": 3,
             "tree_topk": 2, "json_schema": "s.json"}


def as_flags(values: dict) -> list[str]:
    """Command-line flags giving ``values`` (a list: the flag repeated; True: the flag alone)."""
    argv = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        for item in value if isinstance(value, list) else [value]:
            argv += [flag] if item is True else [flag, str(item)]
    return argv


@pytest.mark.parametrize("values", [FLAT, TREE_FLAT], ids=["chain", "tree"])
def test_flat_yaml_keys_and_flags_build_the_same_nested_config(tmp_path, values):
    """Every flat key, given in a YAML file or as a flag, lands in its group; `to_dict` gives the flat keys back."""
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(values))  # JSON is YAML
    from_file = resolve(load_yaml(path), {}, str(path))
    from_flags = cli.config_from_args(cli.build_parser().parse_args(["generate", *as_flags(values)]))
    assert from_file == from_flags == run_config(**values)
    assert {k: v for k, v in from_file.to_dict().items() if k in values} == values
    if values is FLAT:
        assert (from_file.model, from_file.dtype, from_file.drafter, from_file.draft_model, from_file.gamma,
                from_file.seed, from_file.mesh) == ("tiny-random", "bfloat16", "draft-model", "tiny-random-draft", 3,
                                                    5, "data=1")
        assert from_file.sampling == SamplingParams(0.7, 5, 0.9, 0.125, 1.25, 0.5, -0.25)
        assert from_file.inputs == Inputs(("a", "b c"), "p.jsonl", True, 2, 9, True, (3, 0))
        assert from_file.drafting == DrafterSettings(100, 0.5, 4, 1, (), draft_vocab_source="texts.jsonl")
        assert from_file.constraint == ConstraintSettings(regex="a+") and from_file.tree == TreeSettings()
    else:
        assert from_file.tree == TreeSettings(nodes=5, depth=3, topk=2)
        assert from_file.drafting.datastore == ("sharegpt", "outputs") and from_file.effective_gamma == 5
        assert from_file.constraint == ConstraintSettings(json_schema="s.json")


def test_a_bad_value_names_the_flag_or_the_file_it_came_from(tmp_path):
    """The error's keys (not its message) say where the value came from; plain decoding records gamma 0."""
    path = tmp_path / "run.yaml"
    path.write_text("drafter: oracle\ntop_p: 0.5\n")
    with pytest.raises(ValueError, match=rf"^{path}: top_p must be in \(0, 1\], got 0.0"):
        resolve({**load_yaml(path), "top_p": 0.0}, {"temperature": 0.5}, str(path))
    with pytest.raises(ValueError, match=r"^flags: top_p must be in \(0, 1\], got 0.0"):
        resolve(load_yaml(path), {"top_p": 0.0}, str(path))
    with pytest.raises(ValueError, match=r"^flags: the oracle drafter drafts chains only"):
        resolve(load_yaml(path), {"tree_depth": 3}, str(path))
    assert run_config(drafter="none", gamma=4).gamma == 0 == run_config(drafter="none").to_dict()["gamma"]


def test_stop_id_in_a_config_file_is_an_id_or_a_list(tmp_path):
    path = tmp_path / "run.yaml"
    for text, want in (("stop_id: 7\n", (7,)), ("stop-id: [7, 0]\n", (7, 0))):
        path.write_text(text)
        assert resolve(load_yaml(path), {}, str(path)).inputs.stop_id == want
    path.write_text("stop_id: [7, -1]\n")
    with pytest.raises(ValueError, match=rf"{path}: stop_id must be token ids \(ints >= 0\), got \[7, -1\]"):
        resolve(load_yaml(path), {}, str(path))


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("trees/*.json")), ids=lambda p: p.name)
def test_every_tree_choices_file_is_a_tree_for_its_heads(path):
    """configs/trees/*.json: Medusa-format choices whose every prefix is in the file (a tree),
    for as many heads as the file's name says."""
    shape = load_choices(path)
    choices = {tuple(c) for c in shape.choices}
    assert all(c[:-1] in choices for c in choices if len(c) > 1)
    heads = int(path.stem.split("_")[1].removesuffix("heads"))
    assert shape.depth <= heads and shape.nodes == len(choices) == int(path.stem.split("_")[2])


ROOT = CONFIG_DIR.parent
RUN_FILES = sorted(p for folder in ("configs", "experiments") for p in (ROOT / folder).rglob("*.yaml")
                   if "drafter:" in p.read_text())


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_run_and_sweep_file_loads_its_flat_keys_unchanged(path):
    """Each file's flat keys (a config's, or a sweep's base and grid points) read back from the nested
    config as written: the value of each key in `to_dict`, and in its group (`RunConfig.value`)."""
    raw = load_raw(path)
    if "grid" in raw:
        keys, configs = load_sweep(path)
        given = [{**(raw.get("base") or {}), **dict(zip(keys, point))}
                 for point in itertools.product(*raw["grid"].values())]
    else:
        configs, given = [resolve(load_yaml(path), {}, where=str(path))], [raw]
    assert len(configs) == len(given)
    for cfg, values in zip(configs, given):
        flat = cfg.to_dict()
        for key, value in values.items():
            key = key.replace("-", "_")
            want = [value] if key in ("prompt", "stop_id") and not isinstance(value, list) else value
            assert flat[key] == want and cfg.value(key) == (tuple(want) if isinstance(want, list) else want), key


def load_raw(path):
    import yaml

    return yaml.safe_load(path.read_text()) or {}


# a sweep's base: the 1-layer draft model drafting for tiny-random, two sampled rows
BASE = ("model: tiny-random, drafter: draft-model, draft_model: tiny-random-draft, max_new_tokens: 6, "
        "ignore_eos: true, raw: true, batch_size: 2, prompt: [ab, cde], temperature: 0.8, seed: 3")


def write_sweep(tmp_path, grid="{gamma: [1, 2]}", base=None):
    base = base or f"{{{BASE}}}"
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {base}\ngrid: {grid}\n")
    return path


def test_sweep_writes_records_tables_and_plots(tmp_path):
    out = tmp_path / "out"
    base = f"{{{BASE}, logprobs: 0}}"
    records = sweep(write_sweep(tmp_path, base=base), out, progress=False)
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(records) == len(lines) == 2
    for record, gamma in zip(map(json.loads, lines), [1, 2]):
        assert record["point"] == {"gamma": gamma} and record["config"]["gamma"] == gamma
        assert record["seed"] == 3 and record["jax_version"] and record["device"]
        assert record["git_commit"] is None or len(record["git_commit"]) >= 40
        metrics = record["metrics"]
        assert metrics["emitted_tokens"] == 12 and metrics["wall_s"] > 0
        assert 1.0 <= metrics["mean_accepted_length"] <= gamma + 1
        run = runner.run(load_sweep(write_sweep(tmp_path, base=base))[1][gamma - 1], progress=False)
        recorded = [e["logprob"] for r in run["results"] for e in r["logprobs"]]
        assert metrics["mean_logprob"] == pytest.approx(sum(recorded) / 12) and metrics["mean_logprob"] < 0
    rows = list(csv.reader((out / "results.csv").open()))
    assert rows[0][:2] == ["gamma", "mean_accepted_length"] and [r[0] for r in rows[1:]] == ["1", "2"]
    assert rows[0][-1] == "mean_logprob" and all(float(r[-1]) < 0 for r in rows[1:])
    assert (out / "table.md").read_text().count("\n") == 4
    assert (out / "gamma.png").stat().st_size > 1000


@pytest.mark.slow  # CI time: the sweep's loop is covered by test_sweep_writes_records_tables_and_plots
def test_sweep_resumes_without_rerunning_finished_points(tmp_path, monkeypatch):
    path, out = write_sweep(tmp_path), tmp_path / "out"
    sweep(path, out, progress=False)
    lines = (out / "results.jsonl").read_text().splitlines()
    calls = []
    real_run = runner.run
    monkeypatch.setattr(runner, "run", lambda cfg, **kw: calls.append(cfg.gamma) or real_run(cfg, **kw))
    sweep(path, out, progress=False)
    assert calls == []  # every point was there
    (out / "results.jsonl").write_text(lines[0] + "\n" + lines[1][:20])  # a kill mid-write of point 2
    sweep(path, out, progress=False)
    assert calls == [2]
    new = (out / "results.jsonl").read_text().splitlines()
    assert len(new) == 2 and json.loads(new[0]) == json.loads(lines[0]) and json.loads(new[-1])["outputs_sha256"] == json.loads(lines[1])["outputs_sha256"]


@pytest.mark.slow
def test_sweep_drops_compiled_programs_before_each_point(tmp_path, monkeypatch):
    """Compiled programs stay memory-mapped; without this a long sweep on SmolLM2 died of
    vm.max_map_count ("LLVM ERROR: Unable to allocate section memory") after a few points."""
    path, out = write_sweep(tmp_path), tmp_path / "out"
    real_clear, calls = jax.clear_caches, []
    monkeypatch.setattr(jax, "clear_caches", lambda: calls.append(1) or real_clear())
    sweep(path, out, progress=False)
    assert len(calls) == len((out / "results.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow  # CI time; a seed's determinism is also checked by the engine's solo-run tests
def test_same_config_and_seed_give_identical_outputs(tmp_path):
    """Sampled decoding (temperature 0.8) from scratch twice, in two sweep folders: same tokens."""
    path = write_sweep(tmp_path, grid="{seed: [3, 4]}", base=(
        "{model: tiny-random, drafter: oracle, gamma: 2, max_new_tokens: 8, ignore_eos: true, raw: true, "
        "batch_size: 2, prompt: [ab, cde], temperature: 0.8}"))
    first = sweep(path, tmp_path / "a", progress=False)
    again = sweep(path, tmp_path / "b", progress=False)
    assert [r["outputs_sha256"] for r in first] == [r["outputs_sha256"] for r in again]
    assert first[0]["outputs_sha256"] != first[1]["outputs_sha256"]  # the seed matters
    cfg = load_sweep(path)[1][0]
    assert runner.run(cfg, progress=False)["results"] == runner.run(cfg, progress=False)["results"]


@pytest.mark.parametrize("text, message", [
    ("base: {model: tiny-random}\ngrid: {gama: [1, 2]}\n", "grid: unknown key 'gama'"),
    ("base: {modle: tiny-random}\ngrid: {gamma: [1]}\n", "base: unknown key 'modle'"),
    ("base: {}\ngrid: {gamma: 4}\n", "grid key 'gamma' needs a non-empty list"),
    ("base: {}\ngrid: {gamma: [2, -1]}\n", "point {'gamma': -1}: gamma must be an int >= 0"),
    ("base: {}\n", "a sweep file has the keys"),
    ("grid: {gamma: [1]}\nextra: 1\n", r"unknown key 'extra' \(known: base, grid\)"),
    ("grid: {}\n", "grid is empty"),
])
def test_bad_sweep_files_name_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_sweep(path)
    assert str(path) in str(err.value)


def test_sweep_cli_prints_the_table_and_errors_cleanly(tmp_path, capsys):
    path = write_sweep(tmp_path, grid="{gamma: [1]}")
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 0
    assert "| gamma | mean_accepted_length" in capsys.readouterr().out
    assert main(["sweep", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "sweep file not found" in capsys.readouterr().err


def test_a_sweep_over_constraints(tmp_path):
    """regex is a config key like any other: a grid over two regexes, each point constrained by its own
    ("yes" or "no": 3 or 2 bytes; three digits: 3)."""
    base = "{model: tiny-random, drafter: ngram, gamma: 2, max_new_tokens: 8, raw: true, prompt: [ab]}"
    path = write_sweep(tmp_path, grid="{regex: ['(yes|no)', '[0-9]{3}']}", base=base)
    records = sweep(path, tmp_path / "out", progress=False)
    assert [r["point"]["regex"] for r in records] == ["(yes|no)", "[0-9]{3}"]
    emitted = [r["metrics"]["emitted_tokens"] for r in records]
    assert emitted[0] in (2, 3) and emitted[1] == 3

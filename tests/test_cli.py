"""The command line: output of a good call, one clean line and exit 2 on bad input."""

import dataclasses
import json

import jax
import pytest

from specdec_jax import cli, engine, runner
from specdec_jax.cli import main
from specdec_jax.config import RunConfig, run_config
from specdec_jax.models import LoadedModel, load_model
from specdec_jax.models.llama import Llama
from specdec_jax.models.loading import save_model_dir
from specdec_jax.sampling import SamplingParams


def test_theory_prints_closed_form(capsys):
    assert main(["theory", "--alpha", "0.8", "--gamma", "4"]) == 0
    assert "3.3616" in capsys.readouterr().out


def test_bad_value_is_one_line_and_exit_2(capsys):
    assert main(["theory", "--alpha", "1.5", "--gamma", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "alpha must be in [0, 1], got 1.5" in err[0]


# ---------------------------------------------------------------- generate on tiny-random (no download)
#
# Compiles dominate the cost: every good call below shares one shape (batch 1, prompts < 16
# bytes, capacity 64, EOS on), so only two programs are built: ngram gamma=4 and plain.

BASE = ["generate", "--model", "tiny-random", "--raw", "--max-new-tokens", "8", "--gamma", "4"]
METRIC_KEYS = {"rounds", "draft_tokens", "accepted_tokens", "emitted_tokens", "mean_accepted_length",
               "acceptance_rate", "per_position_acceptance", "wall_s", "tokens_per_s", "width_rounds"}


def generate_json(tmp_path, capsys, *args, name="out.json"):
    out = tmp_path / name
    assert main([*BASE, *args, "--json", str(out)]) == 0
    captured = capsys.readouterr()
    return json.loads(out.read_text()), captured


def test_generate_prints_texts_stats_and_writes_json(tmp_path, capsys):
    report, captured = generate_json(tmp_path, capsys, "--prompt", "hello hello", "--prompt", "abcabcabc")
    assert set(report) == {"config", "results", "metrics", "shape_policies"}
    assert report["shape_policies"] == [None, None]  # one per batch (of 1); a fixed gamma (4) has no policy
    cfg = report["config"]
    assert (cfg["model"], cfg["drafter"], cfg["gamma"], cfg["raw"], cfg["max_new_tokens"]) == (
        "tiny-random", "ngram", 4, True, 8)
    assert cfg["prompt"] == ["hello hello", "abcabcabc"]

    results = report["results"]
    assert [r["id"] for r in results] == ["prompt-0", "prompt-1"]
    for r, text in zip(results, ["hello hello", "abcabcabc"]):
        assert {"id", "prompt_tokens", "tokens", "text", "stop_reason"} <= set(r)
        assert r["prompt"] == text and r["prompt_tokens"] == list(text.encode())  # byte tokenizer, raw
        assert 1 <= len(r["tokens"]) <= 8 and all(isinstance(t, int) for t in r["tokens"])
        assert r["stop_reason"] in ("length", "eos")
        if r["stop_reason"] == "length":
            assert len(r["tokens"]) == 8
        else:
            assert r["tokens"][-1] == 257 and 257 not in r["tokens"][:-1]  # ByteTokenizer EOS, kept
        assert r["text"] == bytes(t for t in r["tokens"] if t < 256).decode("utf-8", errors="replace")
        assert f"=== {r['id']} ({r['stop_reason']}, {len(r['tokens'])} tokens)\n{r['text']}\n" in captured.out

    m = report["metrics"]
    assert set(m) == METRIC_KEYS
    emitted = sum(len(r["tokens"]) for r in results)
    assert m["emitted_tokens"] == emitted
    assert 1 <= m["rounds"] <= emitted and m["draft_tokens"] >= m["accepted_tokens"] >= 0
    assert m["mean_accepted_length"] == pytest.approx(emitted / m["rounds"])
    if m["draft_tokens"]:
        assert m["acceptance_rate"] == pytest.approx(m["accepted_tokens"] / m["draft_tokens"])
    assert len(m["per_position_acceptance"]) == 4
    assert m["wall_s"] > 0 and m["tokens_per_s"] == pytest.approx(emitted / m["wall_s"])

    stats = [line for line in captured.out.splitlines() if line.startswith("[")]
    assert len(stats) == 1 and stats[0].startswith("[ngram gamma=4]")
    assert f"{emitted} tokens in" in stats[0]
    assert captured.out.count("===") == 2
    assert "wrote" in captured.err and "Traceback" not in captured.err


def test_ngram_through_cli_is_lossless_vs_plain(tmp_path, capsys):
    prompts = ["--prompt", "hello hello", "--prompt", "abcabcabc"]
    spec, _ = generate_json(tmp_path, capsys, *prompts, "--drafter", "ngram", name="ngram.json")
    plain, captured = generate_json(tmp_path, capsys, *prompts, "--drafter", "none", name="plain.json")
    assert [r["tokens"] for r in spec["results"]] == [r["tokens"] for r in plain["results"]]
    assert [r["text"] for r in spec["results"]] == [r["text"] for r in plain["results"]]
    assert plain["metrics"]["draft_tokens"] == 0 and plain["metrics"]["acceptance_rate"] is None  # NaN -> null
    assert plain["metrics"]["rounds"] == plain["metrics"]["emitted_tokens"]
    assert "[plain " in captured.out
    assert "acceptance n/a" in captured.out and "nan" not in captured.out  # nothing drafted


def test_penalty_flags_reach_the_engine(tmp_path, capsys, monkeypatch):
    seen = []
    real = runner.generate
    monkeypatch.setattr(runner, "generate", lambda *a, **kw: seen.append(kw["sampling"]) or real(*a, **kw))
    report, _ = generate_json(tmp_path, capsys, "--prompt", "hello", "--drafter", "none", "--repetition-penalty",
                              "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "-0.25")
    assert seen == [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.25)]
    cfg = report["config"]
    assert (cfg["repetition_penalty"], cfg["presence_penalty"], cfg["frequency_penalty"]) == (1.3, 0.5, -0.25)


def test_stop_id_ends_a_row_at_its_first_occurrence(tmp_path, capsys):
    """A token of the plain output given as --stop-id cuts the output right after its first
    occurrence, in plain and in speculative decoding (the stop may fall inside an accepted draft run)."""
    prompt = ["--prompt", "hello hello", "--ignore-eos"]
    plain, _ = generate_json(tmp_path, capsys, *prompt, "--drafter", "none", name="plain.json")
    tokens = plain["results"][0]["tokens"]
    stop = max(set(tokens), key=tokens.index)  # the token that appears first the latest
    first = tokens.index(stop)
    assert first >= 2, tokens  # the fixture must cut somewhere inside the output
    for drafter in ("none", "ngram"):
        report, _ = generate_json(tmp_path, capsys, *prompt, "--drafter", drafter, "--stop-id", str(stop),
                                  "--stop-id", "257", name=f"{drafter}.json")
        [result] = report["results"]
        assert result["tokens"] == tokens[: first + 1] and result["stop_reason"] == "eos", drafter
        assert report["config"]["stop_id"] == [stop, 257]


def test_prompt_beyond_the_context_length_is_one_line(tmp_path, capsys):
    """A model folder whose config carries max_positions 16: a 5-token prompt plus 12 new tokens is refused."""
    tiny = load_model("tiny-random")
    config = dataclasses.replace(tiny.config, max_positions=16)
    folder = save_model_dir(tmp_path / "short", LoadedModel(Llama.from_arrays(config, tiny.model.arrays()), config,
                                                            tiny.tokenizer))
    assert main(["generate", "--model", str(folder), "--raw", "--prompt", "hello", "--max-new-tokens", "12"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("specdec-jax: error:") and "context length (16 positions)" in line


def test_jax_runtime_error_is_not_a_user_error(monkeypatch, capsys):
    """Out of memory or a device failure (jax.errors.JaxRuntimeError, a RuntimeError) keeps its
    traceback: it must not be reported as bad input with exit code 2."""
    def out_of_memory(args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 GiB")

    monkeypatch.setattr(cli, "_theory", out_of_memory)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        main(["theory", "--alpha", "0.5", "--gamma", "2"])
    assert "specdec-jax: error" not in capsys.readouterr().err

    def failed_download(args):  # any other RuntimeError is ours to report
        raise RuntimeError("pip download failed: no network")

    monkeypatch.setattr(cli, "_theory", failed_download)
    assert main(["theory", "--alpha", "0.5", "--gamma", "2"]) == 2
    assert one_error_line(capsys) == "specdec-jax: error: pip download failed: no network"


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_no_drafts_prints_acceptance_na(capsys, command):
    """n-grams of 3 in a 2-byte prompt with 3 new tokens never match, so nothing is drafted."""
    flags = ["--model", "tiny-random", "--raw", "--prompt", "xy", "--max-new-tokens", "3", "--ngram-min", "3",
             "--ngram-max", "3", *(["--repeats", "1"] if command == "bench" else [])]
    assert main([command, *flags]) == 0
    out = capsys.readouterr().out
    assert "n/a" in out and "nan" not in out.lower()


def test_config_file_values_used_and_flags_override(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model: tiny-random\nraw: true\ndrafter: ngram\nmax-new-tokens: 3\nseed: 7\n"
                      "prompt:\n  - from yaml\n")
    out = tmp_path / "out.json"
    assert main(["generate", "--config", str(config), "--max-new-tokens", "8", "--json", str(out)]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert cfg["seed"] == 7 and cfg["model"] == "tiny-random" and cfg["raw"] is True  # from the file
    assert cfg["max_new_tokens"] == 8  # the flag wins over the file's 3
    [result] = report["results"]
    assert result["prompt"] == "from yaml" and result["prompt_tokens"] == list(b"from yaml")
    assert len(result["tokens"]) == 8 or result["stop_reason"] == "eos"

    # a flag given on the command line replaces the file's prompt list
    assert main(["generate", "--config", str(config), "--prompt", "from flag", "--json", str(out)]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    assert [r["prompt"] for r in report["results"]] == ["from flag"]
    assert report["config"]["max_new_tokens"] == 3


def test_config_file_prompt_string_is_one_prompt(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("prompt: hi\n")
    out = tmp_path / "out.json"
    rc = main([*BASE, "--config", str(config), "--json", str(out)])
    err = capsys.readouterr().err
    if rc == 2:  # rejecting it with one clear line would be fine too
        assert "prompt" in err and "Traceback" not in err
    else:
        assert [r["prompt"] for r in json.loads(out.read_text())["results"]] == ["hi"]


def test_prompts_file_spec_bench_turns(tmp_path, capsys):
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": ["first turn", "second turn"]}) + "\n\n"
        + json.dumps({"id": "own", "prompt": "plain one"}) + "\n"
        + json.dumps({"turns": ["no id here"]}) + "\n"
    )
    report, captured = generate_json(tmp_path, capsys, "--prompt", "cli", "--prompts-file", str(prompts))
    results = report["results"]
    assert [r["id"] for r in results] == ["prompt-0", 81, "own", 4]  # default id: the line number
    assert [r["prompt"] for r in results] == ["cli", "first turn", "plain one", "no id here"]
    assert results[1]["prompt_tokens"] == list(b"first turn") and results[1]["category"] == "writing"
    assert "=== 81 (" in captured.out


# ---------------------------------------------------------------- bad input: one line on stderr, exit 2


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_unknown_model_name(capsys):
    assert main(["generate", "--model", "no-such-model", "--prompt", "x"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("specdec-jax: error:") and "unknown model 'no-such-model'" in line
    assert "tiny-random" in line and "smollm2-135m" in line


def test_missing_gguf_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    missing = tmp_path / "absent.gguf"
    assert main(["generate", "--model", str(missing), "--prompt", "x"]) == 2
    assert f"no such GGUF file: {missing}" in one_error_line(capsys)


@pytest.mark.parametrize("content, message", [
    ("\n  \n", "no prompts in file"),
    ('{"prompt": "ok"}\n{"prompt": "broken"\n', ":2: not valid JSON"),
    ('{"prompt": "ok"}\n\n["a list"]\n', ":3: expected a JSON object"),
    ('{"turns": []}\n', ":1: needs a string 'prompt'"),
], ids=["empty", "malformed", "not-object", "no-prompt"])
def test_bad_prompts_file(tmp_path, capsys, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    assert main([*BASE, "--prompts-file", str(path)]) == 2
    line = one_error_line(capsys)
    assert str(path) in line and message in line


@pytest.mark.parametrize("flags, message", [
    pytest.param(["--gamma", "-1"], "gamma must be an int >= 0 or 'auto', got -1", id="gamma"),
    pytest.param(["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5", id="top-p"),
    pytest.param(["--temperature", "-1"], "temperature must be finite in float32 and >= 0", id="temperature"),
    pytest.param(["--max-new-tokens", "0"], "max_new_tokens must be an int in [1, 2**31 - 2**20), got 0", id="max-new-tokens"),
    pytest.param(["--batch-size", "0"], "batch_size must be an int >= 1, got 0", id="batch-size"),
    pytest.param(["--drafter", "draft-model"], "needs draft_model (--draft-model", id="draft-model"),
    pytest.param(["--dtype", "float16"], "dtype must be one of float32, bfloat16, got 'float16'", id="dtype"),
    pytest.param(["--draft-vocab", "100"], "draft_vocab is for drafter 'draft-model', not 'ngram'",
                 id="draft-vocab-drafter"),
    pytest.param(["--drafter", "draft-model", "--draft-model", "tiny-random-draft", "--draft-vocab", "258"],
                 "a reduced output vocabulary needs 0 < size < 258, got 258", id="draft-vocab-size"),
    pytest.param(["--draft-confidence", "0.5"], "draft_confidence is for drafter 'draft-model' or 'eagle', not 'ngram'",
                 id="draft-confidence-drafter"),
    pytest.param(["--drafter", "draft-model", "--draft-model", "tiny-random-draft", "--draft-confidence", "1"],
                 "draft_confidence must be in [0, 1), got 1.0", id="draft-confidence-range"),
    pytest.param(["--drafter", "draft-model", "--draft-model", "tiny-random-draft", "--draft-confidence", "0.5",
                  "--tree-nodes", "4"], "a draft confidence stops chains", id="draft-confidence-tree"),
    pytest.param(["--prompt", ""], "encodes to no tokens", id="empty-prompt"),
    pytest.param(["--stop-id", "258"], "stop token id 258 is outside the vocabulary [0, 258)", id="stop-id-vocab"),
    pytest.param(["--prompts-file", "/nonexistent/p.jsonl"], "prompts file not found", id="no-prompts-file"),
    pytest.param(["--config", "/nonexistent/run.yaml"], "config file not found", id="no-config-file"),
])
def test_out_of_range_flags(capsys, flags, message):
    assert main([*BASE, "--prompt", "x", *flags]) == 2
    line = one_error_line(capsys)
    assert line.startswith("specdec-jax: error:") and message in line
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--temperature", "-1"], "temperature must be finite in float32 and >= 0, got -1.0"),
    (["--top-k", "-2"], "top_k must be an int >= 0, got -2"),
    (["--min-p", "2"], "min_p must be in [0, 1], got 2.0"),
    (["--repetition-penalty", "0"], "repetition_penalty must be finite in float32 and > 0, got 0.0"),
    (["--presence-penalty", "inf"], "presence_penalty must be finite in float32, got inf"),
    (["--frequency-penalty", "nan"], "frequency_penalty must be finite in float32, got nan"),
    (["--stop-id", "3", "--stop-id", "-1"], "stop_id must be token ids (ints >= 0), got [3, -1]"),
], ids=["top-p", "top-p-zero", "temperature", "top-k", "min-p", "repetition-penalty", "presence-penalty",
        "frequency-penalty", "stop-id"])
def test_bad_sampling_flags_are_one_line_before_any_work(capsys, flags, message):
    """Sampling flags are checked with the config, before a model is loaded."""
    assert main([*BASE, "--prompt", "x", *flags]) == 2
    line = one_error_line(capsys)
    assert line.startswith("specdec-jax: error:") and line.endswith(message)


def test_unknown_yaml_key_names_file_and_key(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("gamma: 2\ngama: 3\n")
    assert main([*BASE, "--prompt", "x", "--config", str(config)]) == 2
    line = one_error_line(capsys)
    assert str(config) in line and "unknown key 'gama'" in line


def test_gamma_auto_is_the_default_and_reports_its_widths(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # the calibration is cached there
    assert RunConfig().gamma == "auto"
    report, captured = generate_json(tmp_path, capsys, "--gamma", "auto", "--prompt", "abcabcabc")
    assert report["config"]["gamma"] == "auto" and "calibrating shapes [0, 1, 2, 3, 4]" in captured.out
    assert len(report["metrics"]["width_rounds"]) == 5  # verify widths 1, 2, 3, 4, 5


def test_bad_yaml_value_names_file(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("gamma: many\n")
    assert main([*BASE[:-2], "--prompt", "x", "--config", str(config)]) == 2  # no --gamma flag over the file
    line = one_error_line(capsys)
    assert str(config) in line and "gamma must be an int >= 0 or 'auto', got 'many'" in line


@pytest.mark.parametrize("flags, message", [
    (["--gamma", "abc"], "argument --gamma: expected an int >= 0 or 'auto', got 'abc'"),
    (["--drafter", "ngram", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_argparse_error_is_one_line_exit_2(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*BASE, *flags])
    assert exit_info.value.code == 2
    line = one_error_line(capsys)
    assert message in line


def test_demo_runs_each_drafter_beside_plain_decoding(capsys):
    from specdec_jax.demo import demo

    cfg = run_config(model="tiny-random", raw=True, prompt=("abcabcabcabc",), max_new_tokens=8, gamma=4)
    report = demo(cfg)
    (row,) = report["by_drafter"]["ngram"]
    assert row["identical"] and row["speedup"] > 0 and row["tokens_per_round"] >= 1
    assert "median speedup" in capsys.readouterr().out


def test_demo_defaults_to_the_qwen_pair_and_smollm2_keeps_its_own(monkeypatch):
    from specdec_jax import demo as demo_module

    seen = []
    monkeypatch.setattr(demo_module, "demo", lambda cfg, repeats=None: seen.append((cfg, repeats)) or {})
    assert main(["demo"]) == 0
    assert main(["demo", "--model", "smollm2-135m", "--repeats", "2"]) == 0
    assert main(["demo", "--draft-model", "some/draft", "--gamma", "3"]) == 0
    (pair, none), (smol, two), (other, _) = seen
    assert (pair.model, pair.drafter, pair.draft_model, pair.gamma, none) == (
        "qwen2.5-coder-1.5b", "draft-model", "qwen2.5-coder-0.5b", 3, None)
    assert (pair.drafting.draft_vocab, pair.drafting.draft_vocab_source) == (32768, "sharegpt")
    assert (smol.drafting.draft_vocab, smol.drafting.draft_vocab_source) == (0, "ids")
    assert (smol.model, smol.drafter, smol.draft_model, two) == ("smollm2-135m", "ngram", None, 2)
    assert (other.model, other.draft_model, other.gamma) == ("qwen2.5-coder-1.5b", "some/draft", 3)


def test_demo_adds_the_cached_eagle_head_for_the_default_model(tmp_path, monkeypatch):
    from specdec_jax import demo as demo_module
    from specdec_jax.drafters.heads import HEAD_MARKER

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert [c.drafter for c in demo_module.demo_configs(RunConfig())] == ["ngram"]
    head = tmp_path / demo_module.EAGLE_HEAD[1]
    head.mkdir(parents=True)
    (head / HEAD_MARKER).write_text("{}")  # what marks a head folder
    configs = demo_module.demo_configs(RunConfig())
    assert [(c.drafter, c.draft_model) for c in configs] == [("ngram", None), ("eagle", str(head))]
    assert [c.drafter for c in demo_module.demo_configs(run_config(model="tiny-random"))] == ["ngram"]


# ---------------------------------------------------------------- token trees (--tree-*)

TREE = ["generate", "--model", "tiny-random", "--raw", "--max-new-tokens", "8", "--prompt", "abcabcabc"]


def test_tree_flags_run_a_lossless_tree_and_report_its_shape(tmp_path, capsys):
    tree_json, plain_json = tmp_path / "tree.json", tmp_path / "plain.json"
    assert main([*TREE, "--tree-depth", "3", "--tree-topk", "2", "--json", str(tree_json)]) == 0
    stats = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert stats[0].startswith("[ngram tree=6 nodes, depth 3, top-2]")
    assert main([*TREE, "--drafter", "none", "--json", str(plain_json)]) == 0
    tree, plain = json.loads(tree_json.read_text()), json.loads(plain_json.read_text())
    assert tree["config"]["tree_depth"] == 3 and tree["config"]["tree_nodes"] is None
    assert [r["tokens"] for r in tree["results"]] == [r["tokens"] for r in plain["results"]]
    rates = tree["metrics"]["per_position_acceptance"]  # by depth: none past the tree's 3
    assert len(rates) == 6 and rates[3:] == [None] * 3 and all(0 <= r <= 1 for r in rates[:3])  # JSON: nan -> null


@pytest.mark.slow  # CI time; auto trees are lossless in test_shape.test_auto_tree_sizes_are_lossless
def test_tree_nodes_auto_chooses_sizes_per_round_losslessly(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # a fresh calibration
    out = tmp_path / "auto.json"
    assert main([*TREE, "--tree-nodes", "auto", "--tree-depth", "3", "--tree-topk", "2", "--json", str(out)]) == 0
    stats = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert stats[0].startswith("[ngram tree=auto (0-6) nodes, depth 3, top-2]")
    report = json.loads(out.read_text())
    assert report["config"]["tree_nodes"] == "auto"
    assert run_config(drafter="ngram", tree_nodes="auto").effective_gamma == "auto"
    wide = run_config(model="tiny-random", drafter="ngram", tree_nodes="auto", tree_depth=8)
    assert engine.widest_gamma(runner.build_drafter(wide, load_model("tiny-random")), wide.effective_gamma) == 16
    plain = tmp_path / "plain.json"
    assert main([*TREE, "--drafter", "none", "--json", str(plain)]) == 0
    assert [r["tokens"] for r in report["results"]] == [r["tokens"] for r in json.loads(plain.read_text())["results"]]


@pytest.mark.parametrize("flags, message", [
    (["--drafter", "oracle", "--tree-topk", "2"], "the oracle drafter drafts chains only"),
    (["--gamma", "4", "--tree-nodes", "8"], "gamma 4 and a tree of 8 nodes exclude each other"),
    (["--tree-depth", "5", "--tree-nodes", "3"], "a tree of 3 nodes cannot be 5 deep"),
    (["--tree-choices", "tree.json"], "tree_choices is for drafter 'medusa', not 'ngram'"),
    (["--tree-nodes", "0"], "tree_nodes must be an int >= 1 or auto, got 0"),
    (["--gamma", "4", "--tree-nodes", "auto"], "gamma 4 and a tree of auto nodes exclude each other"),
    (["--drafter", "medusa", "--draft-model", "x", "--tree-choices", "/nonexistent/tree.json"],
     "cannot read tree choices from /nonexistent/tree.json"),
], ids=["chain-only-drafter", "gamma-and-tree", "depth-over-nodes", "choices-not-medusa", "zero-nodes", "gamma-and-auto-tree",
                                 "no-choices-file"])
def test_bad_tree_flags_are_one_line(capsys, flags, message):
    assert main([*TREE, *flags]) == 2
    line = one_error_line(capsys)
    assert line.startswith("specdec-jax: error:") and message in line


# ---------------------------------------------------------------- grammar constraints (docs/constraints.md)

PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}


def test_regex_and_json_schema_flags_constrain_every_output(tmp_path, capsys):
    """--regex and --json-schema FILE reach the engine: every row matches or validates, speculation
    emits what plain decoding emits."""
    import re

    import jsonschema

    prompts = ["--prompt", "hello hello", "--prompt", "abcabcabc", "--max-new-tokens", "40"]
    regex = r"(yes|no), [a-z]{2,5}( [a-z]{2,5})*\."
    spec, _ = generate_json(tmp_path, capsys, *prompts, "--regex", regex, name="regex.json")
    plain, _ = generate_json(tmp_path, capsys, *prompts, "--regex", regex, "--drafter", "none", name="plain.json")
    assert [r["tokens"] for r in spec["results"]] == [r["tokens"] for r in plain["results"]]
    for r in spec["results"]:
        assert re.fullmatch(regex, r["text"]) and r["stop_reason"] in ("eos", "grammar", "length")
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON_SCHEMA))
    report, captured = generate_json(tmp_path, capsys, *prompts, "--json-schema", str(schema), name="schema.json")
    assert report["config"]["json_schema"] == str(schema)
    for r in report["results"]:
        jsonschema.validate(json.loads(bytes(t for t in r["tokens"] if t < 256)), PERSON_SCHEMA)


@pytest.mark.parametrize("flags, message", [
    (["--regex", "(ab"], "regex '(ab' is not one outlines-core compiles"),
    (["--regex", "[0-9]{30}"], "the constraint's shortest match is 30 tokens, more than max_new_tokens (8)"),
    (["--regex", "a", "--json-schema", "s.json"], "regex and json_schema exclude each other"),
    (["--json-schema", "missing.json"], "json_schema: cannot read missing.json"),
])
def test_bad_constraints_are_one_line_and_exit_2(capsys, flags, message):
    assert main([*BASE, "--prompt", "ab", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("schema, message", [
    ("{not json", "the JSON schema is not valid JSON"),
    ('{"type": "object", "properties": {"a": {"type": "string", "format": "ipv4"}}}',
     "outlines-core cannot turn the JSON schema into a regex"),
])
def test_bad_schema_files_name_the_file(tmp_path, capsys, schema, message):
    path = tmp_path / "schema.json"
    path.write_text(schema)
    assert main([*BASE, "--prompt", "ab", "--json-schema", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"specdec-jax: error: {path}: {message}"), err

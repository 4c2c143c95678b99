"""`specdec-jax sweep FILE --out DIR`: every point of a grid of `generate` runs, one record each.

A sweep file is YAML with two keys::

    base: {model: tiny-random, drafter: oracle, oracle_alpha: 0.8, max_new_tokens: 64,
           batch_size: 16, ignore_eos: true}
    grid: {gamma: [1, 2, 4, 8]}

`base` is a config (the CLI flags with underscores); `grid` maps config keys to
lists of values, and the product of the lists is run, in file order. Every
point is validated before the first one runs. Written to DIR:

    results.jsonl   one line per point: resolved config, the metrics of
                    `generate --json`, timing, a hash of the output tokens,
                    seed, git commit, jax version and device
    results.csv     the swept keys and the scalar metrics, one row per point
    table.md        the same as a markdown table
    <key>.png       for each swept key: metrics against that key, one line per
                    combination of the other swept keys

Resumable: a point whose resolved config is already in results.jsonl is skipped.
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import itertools
import json
import pathlib
import subprocess
from typing import Any

import jax
from tqdm import tqdm

from specdec_jax.config import RunConfig, check_keys, read_yaml, resolve
from specdec_jax.files import exclusive, json_safe, write_text_atomic

SCALAR_METRICS = ("mean_accepted_length", "acceptance_rate", "tokens_per_s", "wall_s", "emitted_tokens", "rounds",
                  "draft_tokens", "accepted_tokens", "mean_logprob")  # mean_logprob: with `logprobs` set
PLOTTED_METRICS = ("mean_accepted_length", "acceptance_rate", "tokens_per_s")
SWEEP_KEYS = ("base", "grid")  # the keys of a sweep file: a config, and key: list of values


def load_sweep(path: str | pathlib.Path) -> tuple[list[str], list[RunConfig]]:
    """(swept keys, one RunConfig per grid point) of a sweep file; every error names the file and key."""
    data = read_yaml(path, "sweep")
    unknown = [key for key in data if key not in SWEEP_KEYS]
    if unknown:
        raise ValueError(f"{path}: unknown key{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))} (known: "
                         f"{', '.join(SWEEP_KEYS)})")
    if "grid" not in data:
        raise ValueError(f"{path}: no 'grid' (key: list of values); a sweep file has the keys 'base' (a config) "
                         "and 'grid'")
    base = check_keys(data.get("base") or {}, f"{path}: base")
    grid = check_keys(data["grid"] or {}, f"{path}: grid")
    if not grid:
        raise ValueError(f"{path}: grid is empty")
    for key, values in grid.items():
        if key == "prompt" or not isinstance(values, list) or not values:
            raise ValueError(f"{path}: grid key {key!r} needs a non-empty list of values (prompts go in base)")
    keys = list(grid)
    configs = []
    for values in itertools.product(*grid.values()):
        point = dict(zip(keys, values))
        configs.append(resolve({**base, **point}, {}, where=f"{path}: point {point}"))
    return keys, configs


def sweep(path: str | pathlib.Path, out: str | pathlib.Path, progress: bool = True) -> list[dict]:
    """Runs the missing points of the sweep file into `out` (locked while it runs: a second sweep on
    the same `out` is refused); returns every record (old and new)."""
    keys, configs = load_sweep(path)
    with exclusive(out, f"sweep {path}"):
        return _run_points(path, keys, configs, pathlib.Path(out), progress)


def finished_points(out: str | pathlib.Path) -> int:
    """Points recorded in ``out``/results.jsonl (a cut last line not counted)."""
    return len(_read_records(pathlib.Path(out) / "results.jsonl"))


def _run_points(path, keys: list[str], configs: list[RunConfig], out: pathlib.Path, progress: bool) -> list[dict]:
    """The body of `sweep`, holding ``out``'s lock."""
    from specdec_jax.models import load_model
    from specdec_jax.runner import drop_compiled_programs, run

    results = out / "results.jsonl"
    records = _read_records(results)
    if results.is_file() and len(records) != sum(1 for line in results.read_text().splitlines() if line.strip()):
        write_text_atomic(results, "".join(json.dumps(json_safe(r)) + "\n" for r in records))  # drop the cut line
    done = {_config_key(r["config"]) for r in records}
    todo = [c for c in configs if _config_key(c.to_dict()) not in done]
    provenance = _provenance()
    models: dict[tuple[str, str], Any] = {}  # (model, dtype) -> LoadedModel, loaded once
    for cfg in tqdm(todo, desc=f"sweep {pathlib.Path(path).name}", unit="point", disable=not progress):
        drop_compiled_programs()
        key = (cfg.model, cfg.dtype)
        target = models.get(key) or models.setdefault(key, load_model(cfg.model, dtype=cfg.dtype))
        report = run(cfg, target=target, progress=False)
        outputs = [r["tokens"] for r in report["results"]]
        record = {
            "point": {k: cfg.value(k) for k in keys},
            "config": cfg.to_dict(),
            "metrics": {**report["metrics"], **mean_logprob(report["results"])},
            "outputs_sha256": hashlib.sha256(json.dumps(outputs).encode()).hexdigest(),
            "seed": cfg.seed,
            **provenance,
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        with results.open("a") as f:  # one line per finished point: a killed sweep resumes from here
            f.write(json.dumps(json_safe(record)) + "\n")
        records.append(record)
    order = {_config_key(c.to_dict()): i for i, c in enumerate(configs)}
    records = sorted((r for r in records if _config_key(r["config"]) in order), key=lambda r: order[_config_key(r["config"])])
    write_tables(records, keys, out)
    plot_sweep(records, keys, out)
    return records


def mean_logprob(results: list[dict]) -> dict:
    """``{"mean_logprob": x}``: the mean log-probability per emitted token of a run with ``logprobs`` (under
    its ``logprobs_mode``; a quick check that a change kept the law), else {}."""
    values = [e["logprob"] for r in results for e in r.get("logprobs", ())]
    if not values:
        return {}
    return {"mean_logprob": None if None in values else sum(values) / len(values)}  # None: a -inf


def write_tables(records: list[dict], keys: list[str], out: pathlib.Path) -> None:
    """results.csv and table.md: swept keys then scalar metrics, one row per point."""
    header = [*keys, *SCALAR_METRICS]
    rows = [[r["point"][k] for k in keys] + [r["metrics"].get(m) for m in SCALAR_METRICS] for r in records]
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(x) for x in row) + " |" for row in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")


def plot_sweep(records: list[dict], keys: list[str], out: pathlib.Path) -> None:
    """<key>.png per swept key: each plotted metric against it, a line per setting of the other keys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key in keys:
        others = [k for k in keys if k != key]
        values = list(dict.fromkeys(r["point"][key] for r in records))
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        fig, axes = plt.subplots(1, len(PLOTTED_METRICS), figsize=(4 * len(PLOTTED_METRICS), 3.4))
        groups: dict[tuple, list[dict]] = {}
        for r in records:
            groups.setdefault(tuple(r["point"][k] for k in others), []).append(r)
        for ax, metric in zip(axes, PLOTTED_METRICS):
            for group, members in groups.items():
                xs = [m["point"][key] if numeric else values.index(m["point"][key]) for m in members]
                ys = [m["metrics"].get(metric) for m in members]
                label = ", ".join(f"{k}={v}" for k, v in zip(others, group)) or None
                ax.plot(xs, ys, "o-", label=label)
            if not numeric:
                ax.set_xticks(range(len(values)), [str(v) for v in values])
            ax.set(xlabel=key, title=metric.replace("_", " "))
            ax.grid(alpha=0.3)
        if others:
            axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{key}.png", dpi=110)
        plt.close(fig)


def _config_key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def _read_records(path: pathlib.Path) -> list[dict]:
    if not path.is_file():
        return []
    records, lines = [], path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # the last line, cut by a kill: that point runs again
                break
            raise ValueError(f"{path}: line {number} is not JSON") from None
    return records


def _provenance() -> dict:
    """git commit (None outside a checkout; '+dirty' with uncommitted changes), jax version, device."""
    folder = pathlib.Path(__file__).resolve().parent

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {"git_commit": commit, "jax_version": jax.__version__, "device": str(jax.devices()[0])}


def _cell(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)

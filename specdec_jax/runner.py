"""From a `RunConfig` to generated text: load models, build the drafter, encode prompts, run batches.

Shared by `specdec-jax generate`, the demo and the benchmarks.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
from tqdm import tqdm

from specdec_jax.config import RunConfig, run_config
from specdec_jax.data import BUILTIN_PROMPTS, load_prompts_file
from specdec_jax.drafters.table import drafter_spec
from specdec_jax.engine import generate
from specdec_jax.metrics import Metrics
from specdec_jax.models import load_model
from specdec_jax.sharding import make_mesh, place_model


def build_drafter(cfg: RunConfig, target, mesh=None):
    """The drafter the config names, built by its entry of the table of drafters (`drafters.table`);
    None for plain decoding. A draft model goes onto `mesh` (`place_model`)."""
    if cfg.effective_gamma == 0:
        return None
    return drafter_spec(cfg.drafter).build(cfg, target, mesh)


def constraint_tables(cfg: RunConfig, tokenizer):
    """The config's grammar constraint (--regex, --json-schema FILE) compiled for ``tokenizer``
    (`constraints.compile_constraint`, cached), or None; a schema file that cannot be read is a ValueError."""
    regex, schema = cfg.constraint.regex, cfg.constraint.json_schema
    if regex is None and schema is None:
        return None
    from specdec_jax.constraints import Constraint, compile_constraint

    if regex is not None:
        return compile_constraint(Constraint(regex=regex), tokenizer)
    try:
        text = pathlib.Path(schema).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"json_schema: cannot read {schema} ({err.__class__.__name__})") from None
    try:
        return compile_constraint(Constraint(json_schema=text), tokenizer)
    except ValueError as err:
        raise ValueError(f"{schema}: {err}") from None


def drop_compiled_programs() -> None:
    """Empties JAX's compile caches. Call it before each of many runs in one process: XLA CPU keeps
    every compiled program memory-mapped, and a few SmolLM2 benches (~24k maps each) exceed
    vm.max_map_count (65,530) with "LLVM ERROR: Unable to allocate section memory"."""
    jax.clear_caches()


def one_device_only(cfg: RunConfig, command: str) -> None:
    """ValueError when a command that times one device is given a mesh."""
    if cfg.mesh is not None:
        raise ValueError(f"{command} times one device: --mesh is for generate and sweep")


def stop_ids(cfg: RunConfig, tokenizer) -> tuple[int, ...]:
    """Token ids that end a row: the model's end tokens (none with --ignore-eos), then cfg.inputs.stop_id."""
    inputs = cfg.inputs
    return tuple(dict.fromkeys((() if inputs.ignore_eos else tuple(tokenizer.stop_ids)) + inputs.stop_id))


def format_rate(x: float | None) -> str:
    """A rate with two decimals; "n/a" where it is undefined (None or NaN: nothing was drafted)."""
    return "n/a" if x is None or math.isnan(x) else f"{x:.2f}"


def prompt_records(cfg: RunConfig) -> list[dict]:
    """[{"id", "prompt"}]: --prompt texts, then --prompts-file, else the built-in prompts."""
    records = [{"id": f"prompt-{i}", "prompt": p} for i, p in enumerate(cfg.inputs.prompt)]
    if cfg.inputs.prompts_file:
        records += load_prompts_file(cfg.inputs.prompts_file)
    return records or [dict(r) for r in BUILTIN_PROMPTS]


def encode(tokenizer, text: str, raw: bool) -> list[int]:
    """Token ids of a prompt, with the model's chat template unless `raw` (or the model has none)."""
    if not raw and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(text)
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError(f"prompt {text[:40]!r} encodes to no tokens")
    return ids


def run(cfg: RunConfig, target=None, drafter=None, records=None, progress: bool = True) -> dict:
    """Generate for every prompt in batches of cfg.inputs.batch_size on the mesh cfg.mesh (default:
    every device on data; the models are placed on it once, `place_model`); returns the JSON-ready report."""
    inputs = cfg.inputs
    target = target or load_model(cfg.model, dtype=cfg.dtype)
    mesh = make_mesh(cfg.mesh)
    mesh = mesh if mesh.size > 1 else None
    if mesh is not None:
        target = place_model(target, mesh, "the target")
    drafter = drafter if drafter is not None else build_drafter(cfg, target, mesh)
    records = records if records is not None else prompt_records(cfg)
    tok = target.tokenizer
    grammar = constraint_tables(cfg, tok)
    encoded = [encode(tok, r["prompt"], inputs.raw) for r in records]
    results, parts, policies, wall = [], [], [], 0.0
    batches = range(0, len(records), inputs.batch_size)
    for start in tqdm(batches, desc=f"{cfg.drafter if cfg.effective_gamma else 'plain'} decoding",
                      unit="batch", disable=not progress, delay=0.5):  # delay: no bar before a first-batch error
        chunk = encoded[start : start + inputs.batch_size]
        out = generate(
            target, chunk, drafter, gamma=cfg.effective_gamma, sampling=cfg.sampling,
            max_new_tokens=inputs.max_new_tokens, stop_ids=stop_ids(cfg, tok),
            seed=cfg.seed, row_ids=range(start, start + len(chunk)), mesh=mesh, grammars=grammar,
            logprobs=inputs.logprobs, logprobs_mode=inputs.logprobs_mode,
        )
        wall += out.wall_s
        parts.append(out.metrics)
        policies.append(dataclasses.asdict(out.policy) if out.policy is not None else None)
        for row, (record, ids, tokens, reason) in enumerate(zip(records[start:], chunk, out.tokens, out.stop_reasons)):
            results.append({**record, "prompt_tokens": ids, "tokens": tokens, "text": tok.decode(tokens),
                            "stop_reason": reason, **logprob_entries(out, row)})
    metrics = Metrics.combine(parts)
    summary = {k: v for k, v in metrics.to_dict().items() if k not in ("position_proposed", "position_accepted")}
    summary.update(wall_s=wall, tokens_per_s=metrics.emitted_tokens / wall if wall else float("nan"))
    # shape_policies: per batch, the costs (units of T1) and constants gamma "auto" decided with
    return {"config": cfg.to_dict(), "results": results, "metrics": summary, "shape_policies": policies}


def _logprob(x) -> float | None:
    """A log-prob for JSON: -inf (a token the processed law excludes) as None."""
    return None if x == -math.inf else float(x)


def logprob_entries(out, row: int) -> dict:
    """``{"logprobs": [{"token", "logprob", "top": [[id, logprob], ...]}, ...]}``, one entry per emitted
    token of ``row`` of a `GenerationResult` run with logprobs (-inf as None), else {}."""
    if out.logprobs is None:
        return {}
    ids, logp = out.target_top[row]
    return {"logprobs": [
        {"token": int(token), "logprob": _logprob(out.logprobs[row][i]),
         "top": [[int(t), _logprob(x)] for t, x in zip(ids[i], logp[i])]}
        for i, token in enumerate(out.tokens[row])]}


def shape_label(cfg: RunConfig) -> str:
    """How the run drafts: ``gamma=4``, ``gamma=auto`` or ``tree=12 nodes, depth 4, top-3``."""
    shape = cfg.tree_shape if cfg.gamma else None
    if shape is None:
        return f"gamma={cfg.gamma}"
    nodes = f"auto (0-{shape.nodes})" if cfg.tree.nodes == "auto" else shape.nodes
    return f"tree={nodes} nodes, depth {shape.depth}" + ("" if shape.choices else f", top-{shape.topk}")


def stats_line(report: dict) -> str:
    m, cfg = report["metrics"], run_config(**report["config"])
    return (
        f"[{cfg.drafter if cfg.gamma else 'plain'} {shape_label(cfg)}] {m['emitted_tokens']} tokens in "
        f"{m['wall_s']:.2f}s "
        f"({m['tokens_per_s']:.1f} tok/s), {m['mean_accepted_length']:.2f} tokens/round, "
        f"acceptance {format_rate(m['acceptance_rate'])}"
    )

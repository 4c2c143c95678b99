"""Sharding overhead: tokens/s of tiny-random at batch 32 on 1 CPU device vs 8 CPU devices.

Makes the entry "What does partitioning the program cost: 1 vs 8 CPU devices?" of
experiments/README.md; writes results.json and table.md to experiments/results/mesh_overhead.

    python experiments/mesh_overhead.py [--repeats 3] [--max-new-tokens 64]

One subprocess per device count (XLA_FLAGS=--xla_force_host_platform_device_count,
JAX_PLATFORMS=cpu): 1 device (no mesh), 8 devices as data=8 and as
data=4,model=2. Plain decoding and the oracle drafter (alpha 0.8, gamma 4),
greedy, no EOS, random byte prompts of ragged lengths. Each configuration is
compiled first (untimed), then timed `--repeats` times; median tokens/s. The 8
CPU "devices" share the same cores, so this measures the cost of the
partitioned program (collectives, per-device dispatch), not a speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

import numpy as np

SETUPS = [(1, None), (8, "data=8"), (8, "data=4,model=2")]


def measure(mesh_text: str | None, repeats: int, max_new: int) -> dict:
    """Median tokens/s of plain decoding and the oracle drafter in this process."""
    import jax

    from specdec_jax.drafters import oracle_drafter
    from specdec_jax.engine import generate
    from specdec_jax.models import load_model
    from specdec_jax.sharding import make_mesh, shard_model

    target = load_model("tiny-random")
    mesh = make_mesh(mesh_text) if mesh_text else None
    if mesh is not None:
        shard_model(target.model, mesh)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(8, 33, 32)]
    out = {"devices": jax.device_count(), "mesh": mesh_text or "none"}
    for name, drafter, gamma in (("plain", None, 0),
                                 ("oracle", oracle_drafter(target.config, target.model.params(), 0.8), 4)):
        run = lambda: generate(target, prompts, drafter, gamma=gamma, max_new_tokens=max_new, mesh=mesh)  # noqa: E731
        out[f"{name}_compile_s"] = run().wall_s
        results = [run() for _ in range(repeats)]
        out[f"{name}_tokens_per_s"] = statistics.median(r.metrics.emitted_tokens / r.wall_s for r in results)
        out[f"{name}_runs_tokens_per_s"] = [r.metrics.emitted_tokens / r.wall_s for r in results]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent / "results"
                        / "mesh_overhead")
    parser.add_argument("--worker-mesh", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_mesh is not None:
        print(json.dumps(measure(None if args.worker_mesh == "none" else args.worker_mesh, args.repeats,
                                 args.max_new_tokens)))
        return 0

    from common import markdown_table, save

    rows = []
    for devices, mesh in SETUPS:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        command = [sys.executable, __file__, "--worker-mesh", mesh or "none", "--repeats", str(args.repeats),
                   "--max-new-tokens", str(args.max_new_tokens)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = rows[0]
    table = markdown_table(
        ["devices", "mesh", "plain tok/s", "vs 1 device", "oracle tok/s", "vs 1 device", "compile s (plain, oracle)"],
        [[r["devices"], r["mesh"], r["plain_tokens_per_s"], r["plain_tokens_per_s"] / base["plain_tokens_per_s"],
          r["oracle_tokens_per_s"], r["oracle_tokens_per_s"] / base["oracle_tokens_per_s"],
          f"{r['plain_compile_s']:.1f}, {r['oracle_compile_s']:.1f}"] for r in rows])
    save(args.out, {"batch": 32, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": rows}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

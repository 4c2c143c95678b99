"""Worker of tests/test_multidevice.py, run in a subprocess that sees 8 CPU devices.

    python tests/multidevice_worker.py [--cases ngram,oracle] MESH [MESH ...]   # MESH: "data=4,model=2", ...

prints one JSON object: for every mesh and case (default: all of `cases`), the
emitted tokens and stop reasons of one `generate` call, and the shardings the
loop state carried before and after the loop; the runner's greedy tokens on
`REPLICATION_MESHES`, whose model axis exceeds the models' KV heads; and the
errors of a model axis no replication helps and of a target whose KV heads
were not replicated. "data=1" is one device: the single-device path.

The models of `cases` are tiny random Llamas whose head counts (8 query, 4 KV
heads; the draft model 4 and 4) divide a model axis of 4. Those of
`replicated_kv_heads` have 2 KV heads (the target, as Qwen2.5, with q/k/v
biases) and 1 (the draft model) for model axes of 4 and 8.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
import numpy as np

from specdec_jax import engine, runner, sharding
from specdec_jax.config import RunConfig, run_config
from specdec_jax.constraints import Constraint, compile_constraint
from specdec_jax.drafters import (EagleConfig, EagleDrafter, MedusaConfig, MedusaDrafter, ModelDrafter, NgramDrafter,
                                  oracle_drafter)
from specdec_jax.drafters.eagle import init_eagle
from specdec_jax.models import load_model
from specdec_jax.models.llama import LlamaConfig
from specdec_jax.models.loaded import LoadedModel
from specdec_jax.models.loading import save_model_dir
from specdec_jax.models.registry import random_llama
from specdec_jax.models.tokenizer import ByteTokenizer
from specdec_jax.sampling import SamplingParams

TARGET = LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_layers=1,
                     num_heads=8, num_kv_heads=4, head_dim=8)
DRAFT = LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=4, head_dim=8, tie_embeddings=True)
MAX_NEW = 10
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=1.0)


def prompts() -> list[list[int]]:
    """8 ragged prompts (3..20 tokens), half of them repetitive so that the n-gram drafter drafts."""
    rng = np.random.default_rng(8)
    random = [rng.integers(0, 256, n).tolist() for n in (3, 7, 12, 20)]
    return [p for pair in zip(random, ([5, 6, 7] * 4, [1, 2] * 5, [9] * 6, [3, 4, 5, 6] * 3)) for p in pair]


def cases(target, draft):
    """name -> (drafter, per-row sampling): greedy batches, and batches mixing greedy and sampled rows."""
    mixed = [GREEDY, SAMPLED] * 4
    return {
        "plain": (None, GREEDY),
        "plain-mixed": (None, mixed),
        "ngram": (NgramDrafter(), GREEDY),
        "ngram-mixed": (NgramDrafter(), mixed),
        "draft-model-mixed": (ModelDrafter(DRAFT, draft.params()), mixed),
        "oracle": (oracle_drafter(TARGET, target.params(), 0.7), GREEDY),
        "eagle-mixed": (EagleDrafter(EAGLE, init_eagle(EAGLE, jax.random.key(2))), mixed),
        "medusa-mixed": (MedusaDrafter(MEDUSA, medusa_params()), mixed),
        "draft-model-constrained-mixed": (ModelDrafter(DRAFT, draft.params()), mixed),  # `row_grammars`
    }


def row_grammars(name: str):
    """Per-row grammar tables of a case whose name says "constrained" (every other row; None: none)."""
    if "constrained" not in name:
        return None
    tables = compile_constraint(Constraint(regex=r"[a-e]{1,4}( [a-e]{1,4})*\."), ByteTokenizer())
    return [tables if row % 2 else None for row in range(len(prompts()))]


EAGLE = EagleConfig(TARGET.hidden_size, TARGET.vocab_size, 128, 8, 4, 8, feature_layers=(0, -1))  # 4 KV heads
MEDUSA = MedusaConfig(TARGET.hidden_size, TARGET.vocab_size, 3)


def medusa_params() -> dict:
    rng = np.random.default_rng(3)
    h = TARGET.hidden_size
    return {"w": (rng.standard_normal((3, h, h)) / np.sqrt(h)).astype(np.float32),
            "b": np.zeros((3, h), np.float32)}


def specs(tree) -> list[str]:
    return sorted({str(getattr(x.sharding, "spec", "one device")) for x in jax.tree.leaves(tree)})


def run(mesh_text: str, names: list[str], target, draft) -> dict:
    mesh = sharding.make_mesh(mesh_text)
    out = {}
    for name in names:
        drafter, sampling = cases(target, draft)[name]
        gamma = 0 if drafter is None else 3
        kwargs = dict(gamma=gamma, sampling=sampling, max_new_tokens=MAX_NEW, seed=5, mesh=mesh,
                      grammars=row_grammars(name))
        result = engine.generate(target, prompts(), drafter, **kwargs)
        out[name] = {"tokens": result.tokens, "stop_reasons": result.stop_reasons}
    run = engine.prepare(target, prompts(), NgramDrafter(), gamma=3, max_new_tokens=MAX_NEW, mesh=mesh)
    after = engine.run_loop(run.spec, run.params, run.state)
    out["shardings"] = {
        "cache_before": specs(run.state.cache.k), "cache_after": specs(after.cache.k),
        "tokens_before": specs(run.state.tokens), "tokens_after": specs(after.tokens),
        "wq": specs(run.params.target["wq"]), "wo": specs(run.params.target["wo"]),
    }
    return out


KV_TARGET = LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_layers=1,
                        num_heads=8, num_kv_heads=2, head_dim=8, attention_bias=True)
KV_DRAFT = LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=8, num_kv_heads=1, head_dim=4, tie_embeddings=True)
REPLICATION_MESHES = ("data=1,model=4", "data=1,model=8")
TEXTS = ("abcabcabcabc", "hello hello hello", "xyzzy", "the cat sat on the mat, the cat", "q", "0101010101",
         "speculative", "aaaa")


def replicated_kv_heads() -> dict:
    """The tokens of `runner.run` (greedy, batch 8) with `KV_TARGET` on one device, plain decoding
    (greedy speculative decoding emits the same tokens; the cheapest reference), and per mesh of
    `REPLICATION_MESHES` with the draft-model drafter (gamma 3) and `KV_DRAFT`, read from a saved
    folder as --draft-model does: the runner places both with `sharding.place_model`. Per mesh
    also the KV heads and `wk` sharding of the target as placed."""
    target = LoadedModel(random_llama(KV_TARGET, seed=4), KV_TARGET, ByteTokenizer())
    records = [{"id": str(i), "prompt": text} for i, text in enumerate(TEXTS)]
    common = dict(model="kv-target", max_new_tokens=MAX_NEW, batch_size=len(TEXTS), raw=True)

    def tokens(cfg: RunConfig) -> list[list[int]]:
        return [r["tokens"] for r in runner.run(cfg, target=target, records=records, progress=False)["results"]]

    out = {"data=1": {"tokens": tokens(run_config(drafter="none", mesh="data=1", **common))}}
    with tempfile.TemporaryDirectory() as folder:
        save_model_dir(folder, LoadedModel(random_llama(KV_DRAFT, seed=5), KV_DRAFT, ByteTokenizer()))
        for mesh in REPLICATION_MESHES:
            placed = sharding.place_model(target, sharding.make_mesh(mesh), "the target")
            out[mesh] = {"tokens": tokens(run_config(drafter="draft-model", draft_model=folder, gamma=3, mesh=mesh,
                                                    **common)),
                         "kv_heads": placed.config.num_kv_heads, "wk": specs(placed.model.params()["wk"])}
    return out


def errors() -> dict:
    """The messages of a model axis that no KV-head replication helps (the runner, tiny-random's
    4 query heads on model=3) and of `generate` on a target whose 2 KV heads were not replicated
    for model=4 ("no error" where none is raised)."""
    out = {"indivisible": "no error", "unreplicated": "no error"}
    try:
        runner.run(run_config(model="tiny-random", drafter="none", mesh="data=1,model=3", raw=True, prompt=("x",)))
    except ValueError as err:
        out["indivisible"] = str(err)
    try:
        engine.generate(load_model("tiny-random"), [[1, 2]], mesh=sharding.make_mesh("data=2,model=4"))
    except ValueError as err:
        out["unreplicated"] = str(err)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("meshes", nargs="+")
    parser.add_argument("--cases", default=None, help="comma-separated names of `cases` (default: all)")
    args = parser.parse_args()
    target, draft = random_llama(TARGET, seed=1), random_llama(DRAFT, seed=2)
    names = args.cases.split(",") if args.cases else list(cases(target, draft))
    out = {m: run(m, names, target, draft) for m in args.meshes}
    print(json.dumps({"devices": jax.device_count(), "errors": errors(), "replicated_kv_heads": replicated_kv_heads(),
                      "meshes": out}))


if __name__ == "__main__":
    main()

"""Speculative decoding as one jitted `lax.while_loop` (docs/design.md sections 2-4, 9).

    state.py       EngineSpec (static), EngineParams (weights), DecodeState (the loop's pytree)
    round.py       draft_step, verify_step (target_pass, target_law, accept / accept_tree, commit,
                   stop_reasons), decode_round, run_loop; chains and token trees (`specdec_jax.tree`)
    batching.py    validate, bucket, place on a mesh, prefill: prepare -> Prepared (a given policy)
    shape.py       ShapePolicy: the draft length and verify width chosen per round (gamma "auto")
    calibration.py the device costs a ShapePolicy decides with, measured and cached on disk
    generation.py  prepare (gamma "auto" priced by calibration), generate: run the loop, unpack

Imports run one way: state, round, shape -> batching -> calibration -> generation.

The engine imports no model module and names no drafter: the target is a
`specdec_jax.target.TargetModel` (a pure `apply` with explicit positions and
block mask), the drafter follows `specdec_jax.drafters.base`'s protocol, and
every random draw is keyed by `specdec_jax.rng`. Given a device mesh
(`specdec_jax.sharding`), weights, caches and state are sharded over it and the
same program runs partitioned; output reaches the host after the loop only.
"""

from specdec_jax.engine.batching import AUTO, Prepared, default_capacity, prefill, prompt_bucket, validate
from specdec_jax.engine.calibration import calibrated_costs, measure_costs, policy_from_costs, shape_policy
from specdec_jax.engine.generation import generate, prepare
from specdec_jax.engine.round import (
    TargetPass,
    accept,
    accept_tree,
    commit,
    decode_round,
    draft_room,
    draft_step,
    position_keys,
    run_loop,
    stop_reasons,
    target_argmax,
    target_law,
    target_pass,
    verify_step,
)
from specdec_jax.engine.shape import AUTO_GAMMAS, ShapePolicy, auto_shapes, tree_sizes
from specdec_jax.engine.state import (
    CAPACITY,
    EOS,
    LENGTH,
    RUNNING,
    STOP_REASONS,
    DecodeState,
    EngineParams,
    EngineSpec,
    GenerationResult,
)

__all__ = [
    "AUTO", "AUTO_GAMMAS", "CAPACITY", "EOS", "LENGTH", "RUNNING", "STOP_REASONS", "DecodeState", "EngineParams",
    "EngineSpec", "ShapePolicy", "TargetPass", "auto_shapes", "calibrated_costs", "measure_costs", "policy_from_costs",
    "shape_policy", "tree_sizes",
    "GenerationResult", "Prepared", "accept", "accept_tree", "commit", "decode_round", "default_capacity", "draft_room",
    "draft_step", "generate", "position_keys", "prefill", "prepare", "prompt_bucket", "run_loop", "stop_reasons",
    "target_argmax", "target_law", "target_pass", "validate", "verify_step",
]

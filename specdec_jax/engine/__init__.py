"""Speculative decoding as one jitted `lax.while_loop`, run in chunks (docs/design.md sections 2-4, 9).

    state.py       EngineSpec (static), EngineParams (weights), DecodeState (the loop's pytree)
    round.py       draft_step, verify_step (target_pass, target_law, accept / accept_tree, commit,
                   stop_reasons), decode_round, run_loop; chains and token trees (`specdec_jax.token_tree`)
    shape.py       ShapePolicy: the draft length and verify width chosen per round (gamma "auto")
    request.py     GenerateRequest: a call's inputs, validated once; buckets and host-side arrays
    memory.py      whether a batch fits the device's free memory (checked before anything runs)
    batching.py    bucket, build the program, place on a mesh, prefill: prepare -> Prepared
    calibration.py the device costs a ShapePolicy decides with, measured and cached on disk
    generation.py  prepare (gamma "auto" priced by calibration), generate: run the loop in chunks, unpack

Imports run one way: state, round, shape -> request, memory -> batching -> calibration -> generation.

The engine imports no model module and names no drafter: the target is a
`specdec_jax.target.TargetModel` (a pure `apply` with explicit positions and
block mask), the drafter follows `specdec_jax.drafters.base`'s protocol, and
every random draw is keyed by `specdec_jax.rng`. Given a device mesh
(`specdec_jax.sharding`), weights, caches and state are sharded over it and the
same program runs partitioned. `generate` calls the compiled loop in chunks of
about a second (`generation.run_chunks`): between chunks only each row's
``done`` and the round count reach the host; the tokens reach it after the last.
"""

from specdec_jax.engine.batching import Prepared
from specdec_jax.engine.calibration import calibrated_costs, policy_from_costs
from specdec_jax.engine.generation import generate, prepare
from specdec_jax.engine.request import AUTO, GenerateRequest, default_capacity, widest_gamma
from specdec_jax.engine.round import decode_round, draft_room, draft_step, run_loop, verify_step
from specdec_jax.engine.shape import AUTO_GAMMAS, ShapePolicy, auto_shapes, tree_sizes
from specdec_jax.engine.state import EOS, LENGTH, STOP_REASONS, DecodeState, EngineParams, EngineSpec, GenerationResult

__all__ = [
    "AUTO", "AUTO_GAMMAS", "EOS", "LENGTH", "STOP_REASONS", "DecodeState", "EngineParams", "EngineSpec",
    "GenerateRequest", "GenerationResult", "Prepared", "ShapePolicy", "auto_shapes", "calibrated_costs",
    "decode_round", "default_capacity", "draft_room", "draft_step", "generate", "policy_from_costs", "prepare",
    "run_loop", "tree_sizes", "verify_step", "widest_gamma",
]

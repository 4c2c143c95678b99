"""Device meshes, sharding rules and multi-host start-up.

When one device is not enough, generation runs on JAX's own distributed
runtime: the parameters, KV caches and loop state carry ``NamedSharding``s over
a two-axis mesh, and the same jitted ``lax.while_loop`` runs partitioned by
GSPMD. Nothing crosses to the host until the loop ends (:func:`to_host`).

Mesh axes:

    data   rows of the batch
    model  attention heads, KV heads (replicated where ``model`` does not
           divide them) and MLP hidden units (column-parallel projections in,
           row-parallel out: one all-reduce after attention and one after
           the MLP, per layer)

Rules (``H`` hidden, ``N``/``K`` query/KV heads of size ``D``, ``I`` MLP width,
``V`` vocab, ``B`` rows, ``T`` KV slots; layer weights may carry a leading
``[L]`` axis, which is never sharded)::

    wq [N*D, H], wk / wv [K*D, H], w_gate / w_up [I, H]   P('model', None)
    wo [H, N*D], w_down [H, I]                             P(None, 'model')
    bq [N*D], bk / bv [K*D] (Qwen2's biases)               P('model')
    embed [V, H], lm_head [H, V], norms (q/k norms too)    replicated
    KV cache  k [B, K, T, D], v [B, K, D, T] per layer     P('data', 'model')
    loop state with a batch axis, e.g. i32[B], i32[B,Tbuf] P('data')
    scalars (key, step), per-position and width counters   replicated

so ``model`` must divide ``N``, ``K`` and ``I`` (whole heads per device) of the
target and of a draft model or EAGLE head (:func:`check_model_axis`), and
``data`` must divide the padded batch (the engine pads the batch up to a
multiple of it).

KV-head replication: a model axis ``m`` that divides ``N`` and ``I`` but not
``K`` (Qwen2.5's 2 KV heads on ``model=4``) works once every KV head is
repeated ``r = lcm(K, m) / K`` times (:func:`replicate_kv_heads`): ``K*r``
heads, which ``m`` divides, query head ``h`` reading copy ``h // (N / (K*r))``
of the head it read before: the logits are unchanged.
:func:`place_model` replicates (when needed) and shards a target or draft
model; the runner places both through it. An EAGLE head is not replicated:
its ``model`` must divide its ``K``.

A one-device mesh is no mesh: the engine then runs its single-device path.

Known cost: GSPMD partitions the KV-cache write (a scatter with explicit row
and head indices) by all-gathering each step's new keys and values, and their
indices, over ``data`` (B x K x S x D floats per layer, never the cache itself).

Multi-host: every process runs the same program on the same prompts after
:func:`initialize_distributed`; a mesh then spans every process's devices and
each process gets the whole output. Whatever a process decides from its own
clock (the shape policy's calibrated costs) is taken from process 0
(:func:`same_on_every_process`): processes that compiled different constants,
or ran a different number of programs, would leave each other waiting in a
collective.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specdec_jax.kv_cache import KVCache

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

COLUMN_PARALLEL = ("wq", "wk", "wv", "w_gate", "w_up")  # [.., out, in]: out on `model`
ROW_PARALLEL = ("wo", "w_down")  # [.., out, in]: in on `model`
SPLIT_BIASES = ("bq", "bk", "bv")  # [.., out]: out on `model`, as their projections
KV_HEAD_PARAMS = ("wk", "wv", "bk", "bv")  # [.., K*D, H] and [.., K*D]: repeated by `replicate_kv_heads`
# state fields without a batch axis: Counters' per-position and per-width counts, a calibration's forced shape
UNBATCHED_STATE = ("position_proposed", "position_accepted", "width_rounds", "forced_shape")

_MESH_TEXT = re.compile(r"^\s*(\w+)\s*=\s*(\d+)\s*$")


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=4,model=2"`` -> ``{"data": 4, "model": 2}``; an axis left out has size 1."""
    sizes = dict.fromkeys(AXES, 1)
    seen = set()
    for part in text.split(","):
        match = _MESH_TEXT.match(part)
        if not match or match.group(1) not in AXES or match.group(1) in seen or int(match.group(2)) < 1:
            raise ValueError(f"mesh {text!r} is not of the form 'data=N,model=M' (each axis at most once, sizes >= 1)")
        seen.add(match.group(1))
        sizes[match.group(1)] = int(match.group(2))
    return sizes


def make_mesh(text: str | None = None, devices=None) -> Mesh:
    """A ``(data, model)`` mesh from ``"data=4,model=2"`` over the first ``data * model``
    of ``devices`` (default: ``jax.devices()``, every process's). ``None`` puts every
    device on ``data``.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {DATA: len(devices), MODEL: 1} if text is None else parse_mesh(text)
    needed = math.prod(sizes[a] for a in AXES)
    if needed > len(devices):
        raise ValueError(f"mesh data={sizes[DATA]},model={sizes[MODEL]} needs {needed} devices, "
                         f"jax sees {len(devices)}")
    return jax.make_mesh((sizes[DATA], sizes[MODEL]), AXES, axis_types=(AxisType.Auto,) * 2,
                         devices=devices[:needed])


def kv_replication(size: int, num_kv_heads: int) -> int:
    """How many times :func:`place_model` repeats each of ``num_kv_heads`` KV heads for a
    ``model`` axis of ``size``: ``lcm(K, size) / K`` (1 when ``size`` divides ``K``)."""
    return math.lcm(num_kv_heads, size) // num_kv_heads


def check_model_axis(mesh: Mesh, config, what: str = "the model") -> None:
    """ValueError unless the ``model`` axis divides the head counts and MLP width of ``config``
    (as it is placed: after any :func:`replicate_kv_heads`); the message says what would work."""
    size = mesh.shape[MODEL]
    heads, width, kv_heads = config.num_heads, config.intermediate_size, config.num_kv_heads
    for name in ("num_heads", "intermediate_size", "num_kv_heads"):
        if getattr(config, name) % size:
            if heads % size or width % size:
                sizes = ", ".join(str(m) for m in range(1, heads + 1) if heads % m == 0 == width % m)
                advice = (f"model must divide num_heads and intermediate_size ({sizes}); where it does not "
                          "divide num_kv_heads, the KV heads are replicated (sharding.place_model, for a target "
                          "or draft model; an EAGLE head's model axis must divide its num_kv_heads)")
            else:
                advice = (f"replicate its KV heads to {kv_heads * kv_replication(size, kv_heads)} first, as "
                          "sharding.place_model does for a target or draft model (an EAGLE head's KV heads "
                          "are not replicated)")
            raise ValueError(f"mesh axis model={size} does not divide {name} = {getattr(config, name)} of {what} "
                             f"(num_heads {heads}, num_kv_heads {kv_heads}, intermediate_size {width}): {advice}")


def param_spec(name: str, ndim: int) -> P:
    """PartitionSpec of weight ``name`` (see the module docstring) with ``ndim`` axes."""
    if name in COLUMN_PARALLEL:
        return P(*[None] * (ndim - 2), MODEL, None)
    if name in ROW_PARALLEL or name in SPLIT_BIASES:
        return P(*[None] * (ndim - 1), MODEL)
    return P()


def param_shardings(params, mesh: Mesh):
    """NamedShardings for a weight pytree whose leaves sit under their name: the dict of
    ``Llama.params()`` (layer weights as tuples) or an ``nnx.state`` of a ``Llama``."""
    def rule(path, x):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)]
        return NamedSharding(mesh, param_spec(names[-1], x.ndim) if names else P())  # unnamed: grammar tables

    return jax.tree_util.tree_map_with_path(rule, params)


def shard_params(params, mesh: Mesh):
    """``params`` placed on ``mesh`` (a no-op for weights already placed so)."""
    return jax.device_put(params, param_shardings(params, mesh))


def shard_model(model, mesh: Mesh, what: str = "the model") -> None:
    """Moves the weights of an ``nnx`` ``Llama`` onto ``mesh`` in place (after
    :func:`check_model_axis`), so that every later ``model.params()`` hands out
    sharded arrays and ``generate`` copies nothing."""
    check_model_axis(mesh, model.config, what)
    state = nnx.state(model)
    nnx.update(model, shard_params(state, mesh))


def replicate_kv_heads(loaded, factor: int):
    """``loaded`` (a ``LoadedModel``) with each of its ``K`` KV heads repeated ``factor`` times
    in a row: ``wk``, ``wv [L, K*D, H]`` -> ``[L, K*factor*D, H]``, ``bk``, ``bv [L, K*D]`` ->
    ``[L, K*factor*D]`` (Qwen2's biases), ``num_kv_heads`` ``K*factor``; q/k norms ``[L, D]``
    are per head_dim and stay. Query head ``h`` then reads copy ``h // (N / (K*factor))`` of the
    head it read before: the same logits, and a KV cache of ``K*factor`` heads. A new model
    (weights on the default device); ``factor`` 1 returns ``loaded`` itself."""
    if factor == 1:
        return loaded
    config = loaded.config
    heads = config.num_kv_heads * factor
    if factor < 1 or config.num_heads % heads:
        raise ValueError(f"cannot repeat {config.num_kv_heads} KV heads {factor} times: {heads} heads do not "
                         f"divide num_heads {config.num_heads}")
    arrays = loaded.model.arrays()
    for name in KV_HEAD_PARAMS:
        if name in arrays:
            x = arrays[name]
            axis = x.ndim - (2 if name in COLUMN_PARALLEL else 1)  # the K*D axis
            by_head = x.reshape(x.shape[:axis] + (config.num_kv_heads, -1) + x.shape[axis + 1:])
            arrays[name] = np.repeat(by_head, factor, axis=axis).reshape(x.shape[:axis] + (-1,) + x.shape[axis + 1:])
    config = dataclasses.replace(config, num_kv_heads=heads)
    return loaded._replace(model=type(loaded.model).from_arrays(config, arrays), config=config)


def place_model(loaded, mesh: Mesh, what: str = "the model"):
    """``loaded`` (a ``LoadedModel``) with its weights on ``mesh``: its KV heads first repeated
    ``kv_replication`` times when the ``model`` axis divides ``num_heads`` and
    ``intermediate_size`` but not ``num_kv_heads`` (:func:`replicate_kv_heads`, a new
    ``LoadedModel``), then sharded in place (:func:`shard_model`). A ValueError
    (:func:`check_model_axis`) where no replication helps."""
    config, size = loaded.config, mesh.shape[MODEL]
    if config.num_heads % size == 0 and config.intermediate_size % size == 0:
        loaded = replicate_kv_heads(loaded, kv_replication(size, config.num_kv_heads))
    shard_model(loaded.model, mesh, what)
    return loaded


def state_shardings(state, mesh: Mesh):
    """NamedShardings for loop state (or prefill inputs): a ``KVCache`` (the target's or a
    draft model's) ``P('data', 'model')`` and lengths ``P('data')``; other arrays ``P('data')``
    on their leading (batch) axis, except scalars and ``UNBATCHED_STATE``, replicated."""
    def rule(path, x):
        if isinstance(x, KVCache):
            heads = NamedSharding(mesh, P(DATA, MODEL))
            return KVCache(k=(heads,) * len(x.k), v=(heads,) * len(x.v), lengths=NamedSharding(mesh, P(DATA)))
        name = getattr(path[-1], "name", None) if path else None
        return NamedSharding(mesh, P() if x.ndim == 0 or name in UNBATCHED_STATE else P(DATA))

    return jax.tree_util.tree_map_with_path(rule, state, is_leaf=lambda x: isinstance(x, KVCache))


def shard_state(state, mesh: Mesh):
    """``state`` placed by :func:`state_shardings` (host arrays or arrays on one device)."""
    return jax.tree.map(_put, state, state_shardings(state, mesh))


def _put(x, sharding: NamedSharding):
    """``jax.device_put``; PRNG keys go as their key data (device_put cannot send a key
    array to other processes' devices)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jax.device_put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    return jax.device_put(x, sharding)


def constrain_state(state, mesh: Mesh | None):
    """Inside jit: ``state`` constrained to :func:`state_shardings` (unchanged without a mesh)."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh))


def to_host(tree):
    """The arrays of ``tree`` as numpy arrays, whole on every process (across processes,
    an all-gather)."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


COORDINATOR_TIMEOUT_S = 120  # how long every process waits for all of them to join


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, timeout_s: int = COORDINATOR_TIMEOUT_S) -> bool:
    """``jax.distributed.initialize`` from the arguments, else the environment variables
    ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID``. Returns False (and does nothing) when none of them is set. When not every
    process has joined within ``timeout_s``, a RuntimeError says so (jax's own wait is 5 minutes,
    then an abort).

    Call it before anything else touches JAX's devices.
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator_address is None and num_processes is None and process_id is None:
        return False
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id, initialization_timeout=timeout_s)
    except Exception as err:  # noqa: BLE001 - jax raises its runtime's errors; say what to check
        raise RuntimeError(f"process {process_id} of {num_processes}: not every process joined the coordinator at "
                           f"{coordinator_address} within {timeout_s} s ({str(err).splitlines()[0][:160]}): start "
                           "all of them with the same --coordinator-address and --num-processes") from None
    return True


def least_over_processes(value: int | None) -> int | None:
    """The least of every process's ``value`` (None where any process has None); ``value`` itself in a
    single-process run. Every process must call it at the same point (it is a collective)."""
    if jax.process_count() == 1:
        return value
    values = multihost_utils.process_allgather(np.int64(-1 if value is None else value))
    return None if (values < 0).any() else int(values.min())


def same_on_every_process(value):
    """``value`` (anything JSON can hold) as process 0 has it, on every process; ``value`` itself
    in a single-process run. Every process must call it at the same point (it is a collective)."""
    if jax.process_count() == 1:
        return value
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    padded = np.zeros(size, np.uint8)
    padded[: min(size, data.size)] = data[:size]
    return json.loads(bytes(multihost_utils.broadcast_one_to_all(padded)).decode())

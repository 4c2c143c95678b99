"""Whether a generation fits the device's free memory, checked before it runs.

Memory is checked against the device memory free now (`free_device_bytes`,
measured once per request), in three steps, each a one-line ValueError with the
sizes and the shapes: `check_memory_floor` (arithmetic, before compiling: the
KV cache and the widest verify pass's largest array), then the compiled
prefill's own accounting (`batching.compiled_prefill`) and, for `generate`,
the compiled decoding loop's (`compiled_loop`: its state and one round's
working memory).

Both compiled programs and their memory accounting are kept (`compile_once`) for the last
`KEPT_PROGRAMS` signatures, so a call that repeats one (a benchmark's repeats, a demo's prompts of
one bucket) neither traces nor analyses its programs again: about 0.25 s a call for the
Qwen2.5-Coder pair on a CPU.
"""

from __future__ import annotations

import collections
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.engine.round import run_loop
from specdec_jax.engine.state import EngineParams, EngineSpec
from specdec_jax.target import TargetModel

KEPT_PROGRAMS = 8  # compiled programs `compile_once` keeps (each holds its executable's memory mappings)
_KEPT: collections.OrderedDict = collections.OrderedDict()
MEMORY_FIX = "shorten the prompt, or lower max_new_tokens, gamma (a tree's nodes) or the batch size"


def check_memory_floor(model: TargetModel, lens: np.ndarray, capacity: int, gamma: int, devices: int,
                       free: int | None) -> None:
    """ValueError with the sizes when `memory_floor` exceeds ``free`` bytes (None: unknown, no check): a
    shape that cannot fit is refused in milliseconds, before any program is compiled."""
    state, work = memory_floor(model, lens.shape[0], capacity, gamma, devices)
    if free is not None and state + work > free:
        raise ValueError(f"the decoding state needs {format_size(state)} and the widest verify pass at least "
                         f"{format_size(work)} more ({describe_shapes(lens, capacity, gamma)}) but the device has "
                         f"{format_size(free)} free: {MEMORY_FIX}")


def memory_floor(model: TargetModel, batch: int, capacity: int, gamma: int, devices: int = 1) -> tuple[int, int]:
    """``(state, work)``: bytes per device that decoding must hold at least, from the shapes alone: the
    target's KV cache (its ``init_cache``, traced abstractly), and the larger of two arrays that the
    widest verify pass (W = gamma + 1 tokens) materializes whatever XLA fuses: one attention head's
    float32 scores f32[B,W,T+W] (over the cache and the pass itself) and its float32 logits f32[B,W,V].
    Over ``devices`` devices, the even share (no device holds less than that of the largest)."""
    cache = jax.eval_shape(lambda: model.init_cache(batch, capacity))
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    width = gamma + 1
    work = 4 * batch * width * max(capacity + width, model.vocab_size)
    return -(-state // devices), -(-work // devices)


def compiled_loop(spec: EngineSpec, params: EngineParams, state, lens: np.ndarray, free: int | None) -> Callable:
    """`run_loop` compiled for ``state`` (`batching.loop_state_shapes`) and a traced round count, as
    `generate` calls it (the call finds this executable in jax's cache: nothing is compiled twice), after a
    ValueError with the numbers when the loop needs more than ``free`` bytes: the state it is given
    (donated: the loop writes its output in place of it), one round's working memory (temp: the verify
    pass's attention scores and logits at its widest, a tree's masks, the drafter's own) and any output
    not written in place (per device of a mesh, from the compiled program's own accounting; None:
    unknown, no check)."""
    compiled, stats = compile_once(run_loop, spec, params, state, jax.ShapeDtypeStruct((), jnp.int32))
    if stats is not None and free is not None:
        held = device_bytes(state)
        work = stats.temp_size_in_bytes + max(0, stats.output_size_in_bytes - stats.alias_size_in_bytes)
        if held + work > free:
            raise ValueError(f"the decoding loop needs {format_size(held + work)} (the decoding state "
                             f"{format_size(held)} and one round's working memory {format_size(work)}: "
                             f"{describe_shapes(lens, spec.capacity, spec.gamma)}) but the device has "
                             f"{format_size(free)} free: {MEMORY_FIX}")
    return compiled


def compile_once(jitted, spec, *args):
    """``(compiled, stats)``: ``jitted.lower(spec, *args).compile()`` (``spec`` its static argument) and its
    `memory_analysis()`, kept for the last `KEPT_PROGRAMS` signatures: the same spec and arguments of the
    same shapes, dtypes and shardings (the weights' values are arguments, not part of the program) find
    both without tracing or analysing again (the analysis alone took 0.12 s a program for the
    Qwen2.5-Coder pair on a CPU)."""
    leaves, tree = jax.tree.flatten(args)
    key = (jitted, spec, tree, tuple((jax.api_util.shaped_abstractify(x), getattr(x, "sharding", None))
                                     for x in leaves))
    if key in _KEPT:
        _KEPT.move_to_end(key)
        return _KEPT[key]
    compiled = jitted.lower(spec, *args).compile()
    _KEPT[key] = kept = (compiled, compiled.memory_analysis())
    if len(_KEPT) > KEPT_PROGRAMS:
        _KEPT.popitem(last=False)
    return kept


def describe_shapes(lens: np.ndarray, capacity: int, gamma: int) -> str:
    """The shapes a memory error names: batch, KV slots, the longest prompt, gamma and the verify width."""
    return (f"batch {lens.shape[0]}, {capacity} KV slots per row: the longest prompt, row {int(np.argmax(lens))}, has "
            f"{int(lens.max())} tokens; gamma {gamma}, verify passes of up to {gamma + 1} tokens")


def format_size(nbytes: int) -> str:
    """Bytes as GiB (MiB below 1 GiB), one decimal."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def device_bytes(tree) -> int:
    """Bytes of the arrays (or shapes) of ``tree`` on one device: a sharded array's shard."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.shape if getattr(x, "sharding", None) is None else x.sharding.shard_shape(x.shape)
        total += int(np.prod(shape, dtype=np.int64)) * x.dtype.itemsize
    return total


def free_device_bytes(device=None) -> int | None:
    """Bytes free on ``device`` (default this process's first): its allocator's limit less its use on an
    accelerator, the host's available memory (/proc/meminfo MemAvailable) on CPU; None where unknown."""
    device = device or jax.local_devices()[0]  # another process's devices have no memory_stats here
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

"""Shared pieces of the engine tests: models, prompts, cached reference runs,
hand-driven rounds, cache rebuilding, and the tie-aware greedy comparator.

Compiles cost seconds on CPU, so every test that can reuses one shape family:
the ragged batch `RAGGED` (batch bucket 4, prompt bucket 32), `MAX_NEW`
tokens, gamma `GAMMA`, the default capacity (128) and the EOS id picked by
`eos_id()`. Reference outputs are cached per process, so test files run by one
pytest process share them.

The tie-aware comparator is the library's (`specdec_jax.compare`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import engine
from specdec_jax.compare import compare_rows
from specdec_jax.drafters import EagleConfig, MedusaConfig, ModelDrafter, NgramDrafter, oracle_drafter
from specdec_jax.drafters.base import DrafterBase, Proposal
from specdec_jax.drafters.eagle import init_eagle
from specdec_jax.drafters.heads import save_head
from specdec_jax.engine import ShapePolicy
from specdec_jax.models import load_model
from specdec_jax.models.llama import LlamaConfig, forward
from specdec_jax.sampling import SamplingParams
from specdec_jax.token_tree import TreeShape

MAX_NEW = 40
GAMMA = 4


def _ragged_prompts() -> list[list[int]]:
    rng = np.random.default_rng(1234)
    return [
        rng.integers(0, 256, 3).tolist(),  # short, random
        rng.integers(0, 256, 9).tolist(),  # random
        [10, 20, 30, 40] * 4 + [10],  # 17 tokens, repetitive: n-gram matches at once
        [1, 2, 3, 4, 5, 6] * 5,  # 30 tokens, repetitive
    ]


RAGGED = _ragged_prompts()  # lengths 3, 9, 17, 30


@functools.cache
def target():
    return load_model("tiny-random")


@functools.cache
def draft():
    return load_model("tiny-random-draft")


def random_head(kind: str, folder) -> str:
    """A random EAGLE head (one small layer) or 3 Medusa heads for tiny-random, saved as the head
    folder `--draft-model PATH` loads; returns its path."""
    cfg = target().config
    if kind == "eagle":
        head = EagleConfig(cfg.hidden_size, cfg.vocab_size, 64, 2, 1, 32)
        arrays = init_eagle(head, jax.random.key(5))
    else:
        rng, h = np.random.default_rng(5), cfg.hidden_size
        head = MedusaConfig(h, cfg.vocab_size, 3)
        arrays = {"w": (rng.standard_normal((3, h, h)) / np.sqrt(h)).astype(np.float32),
                  "b": rng.standard_normal((3, h)).astype(np.float32)}
    return str(save_head(folder, kind, head, arrays, {}))


def ngram() -> NgramDrafter:
    return NgramDrafter()


def model_drafter() -> ModelDrafter:
    return ModelDrafter(draft().config, draft().model.params())


def oracle(alpha: float) -> ModelDrafter:
    return oracle_drafter(target().config, target().model.params(), alpha)


DECOY_PARENTS = (-1, -1, 0, 1, 1, 4, 4)
DECOY_NODES = {0: 0, 1: 2, 2: 5, 3: 7}  # nodes kept for 0..3 chain drafts (always a prefix)


@dataclasses.dataclass(frozen=True)
class DecoyTree(DrafterBase):
    """A tree drafter for tests: a chain drafter's drafts d1 d2 d3 hidden among decoys
    x' = (x + 1) % V, never as the first child, in a 7-node tree of depth 3:

        t0 -+- d1' -- d2'           nodes 0, 2
            +- d1  -+- d2' (3)      nodes 1, 3
                    +- d2  -+- d3   nodes 4, 5
                            +- d3'  node 6

    The chain's drafts are kept as point masses (its q does not describe the decoys), which
    rule (a) of tree verification verifies exactly: the children do not depend on the
    verifier's draws.
    """

    chain: Any
    vocab_size: int
    params: Any = dataclasses.field(compare=False, repr=False, default=None)
    name: str = "decoy-tree"
    tree: TreeShape = TreeShape(nodes=7, depth=3)

    @property
    def reads_hidden(self):
        return self.chain.reads_hidden

    def check(self, target, mesh):
        self.chain.check(target, mesh)

    def init(self, params, prefill):
        return self.chain.init(params, prefill)

    def propose(self, params, state, ctx, gamma):
        chain, state = self.chain.propose(params, state, ctx, 3)
        d = chain.drafts
        decoy = (d + 1) % self.vocab_size
        tokens = jnp.stack([decoy[:, 0], d[:, 0], decoy[:, 1], decoy[:, 1], d[:, 1], d[:, 2], decoy[:, 2]], axis=1)
        parents = jnp.broadcast_to(jnp.asarray(DECOY_PARENTS, jnp.int32), tokens.shape)
        nodes = jnp.asarray([DECOY_NODES[n] for n in range(4)], jnp.int32)[jnp.clip(chain.num_draft, 0, 3)]
        return Proposal(tokens.astype(jnp.int32), nodes, None, parents), state

    def settle(self, params, state, update):
        return self.chain.settle(params, state, update)

    def commit(self, params, state, outcome):
        return self.chain.commit(params, state, outcome)


def decoy_tree(chain) -> DecoyTree:
    return DecoyTree(chain, target().config.vocab_size, chain.params)


def ngram_trie() -> NgramDrafter:
    return NgramDrafter(tree=TreeShape(nodes=12, depth=4, topk=3))


@functools.cache
def reference_no_eos():
    """Plain decoding (gamma 0) of RAGGED without an EOS id."""
    return engine.generate(target(), RAGGED, max_new_tokens=MAX_NEW)


def choose_eos(outputs: Sequence[Sequence[int]], earliest: int = 4) -> int:
    """A token that occurs mid-run in some row and never in the first `earliest` tokens of any row.

    Among candidates, the one ending the most rows (but not all, so some rows
    stop on the budget) wins; ties go to the smallest id. Deterministic.
    """
    first = [{} for _ in outputs]
    for row, out in zip(first, outputs):
        for i, t in enumerate(out):
            row.setdefault(t, i)
    candidates = []
    for t in sorted(set().union(*first)):
        hits = [row[t] for row in first if t in row]
        if min(hits) >= earliest and len(hits) < len(outputs) and min(hits) <= len(outputs[0]) - 8:
            candidates.append((-len(hits), t))
    assert candidates, "no token occurs mid-run: pick another prompt set"
    return min(candidates)[1]


@functools.cache
def eos_id() -> int:
    return choose_eos(reference_no_eos().tokens)


@functools.cache
def reference():
    """Plain decoding (gamma 0) of RAGGED with `eos_id()`: the output every spec run must match."""
    return engine.generate(target(), RAGGED, max_new_tokens=MAX_NEW, eos_id=eos_id())


# ----------------------------------------------------------------------------
# Driving rounds by hand (from engine.prepare, the state generate's loop starts from)


@dataclasses.dataclass
class HandRun:
    spec: engine.EngineSpec
    params: engine.EngineParams
    state: engine.DecodeState
    num_rows: int

    @property
    def target_params(self):
        return self.params.target

    @property
    def drafter_params(self):
        return self.params.drafter

    def round(self) -> engine.DecodeState:
        """One draft step then one verify step; returns the state after the draft step."""
        drafted = engine.draft_step(self.spec, self.params, self.state)
        self.state = engine.verify_step(self.spec, self.params, drafted)
        return drafted

    def outputs(self) -> tuple[list[list[int]], list[str]]:
        tokens, num, lens, reasons = jax.device_get(
            (self.state.tokens, self.state.num_tokens, self.state.prompt_lens, self.state.stop_reason)
        )
        out = [tokens[b, lens[b] : num[b]].tolist() for b in range(self.num_rows)]
        why = [engine.STOP_REASONS.get(int(r), "running") for r in reasons[: self.num_rows]]
        return out, why


def prepare(
    prompts,
    drafter=None,
    *,
    gamma=0,
    sampling=SamplingParams(),
    max_new_tokens=MAX_NEW,
    eos=None,
    seed=0,
    capacity=None,
) -> HandRun:
    """The state `generate` builds before its loop (`engine.prepare`), for hand-driven rounds."""
    run = engine.prepare(target(), prompts, drafter, gamma=gamma, sampling=sampling, max_new_tokens=max_new_tokens,
                         eos_id=eos, seed=seed, capacity=capacity)
    return HandRun(run.spec, run.params, run.state, run.num_rows)


def reference_ngram(h, gamma, max_n=3, min_n=1, prefer="recent", window=None):
    """The n-gram proposal of docs/design.md section 5 for history `h` (a list), in plain Python."""
    length = len(h)
    for n in range(max_n, min_n - 1, -1):
        if length < n:
            continue
        starts = [
            j for j in range(length - n)  # j + n < L: a continuation exists
            if h[j : j + n] == h[length - n :] and (window is None or j >= length - window)
        ]
        if starts:
            cont = (max if prefer == "recent" else min)(starts) + n
            return h[cont : cont + min(gamma, length - cont)]
    return []


# ----------------------------------------------------------------------------
# Rebuilding caches and teacher-forced logits from scratch

_forward = jax.jit(forward, static_argnums=0, static_argnames="compute_logits")


def rebuild_cache(config: LlamaConfig, params, tokens: np.ndarray, capacity: int):
    """Keys/values (k, v: [L,B,T,Hkv,D]) of a fresh prefill of `tokens` i32[B,W] (W <= capacity).

    Attention is causal, so slot j depends only on tokens 0..j: padding after
    a row's committed tokens does not change its committed slots.
    """
    cache = config.init_cache(tokens.shape[0], capacity)
    _, cache = _forward(config, params, jnp.asarray(tokens, jnp.int32), cache, compute_logits=False)
    return tuple(np.asarray(a) for a in cache.stacked())


def assert_caches_rebuilt(run: HandRun, state: engine.DecodeState, drafter=None) -> None:
    """Asserts the cache invariant after a round (``state``: `host` of ``run.state``): every real row's
    target cache holds its committed tokens but the newest (lengths = num_tokens - 1), each slot equal
    to a fresh prefill of those tokens; with a draft-model ``drafter``, its cache too, on the slots it
    trusts (all but the newest two: it rewrites slot n - 2 at the start of its next round)."""
    capacity = run.spec.capacity
    committed = np.where(np.arange(capacity)[None] < state.num_tokens[:, None], state.tokens[:, :capacity], 0)
    caches = [(state.cache, target().config, run.target_params, 1)]
    if drafter is not None:
        caches.append((state.drafter_state, drafter.config, drafter.params, 2))
    for cache, config, params, untrusted in caches:
        expected, stored = rebuild_cache(config, params, committed, capacity), cache.stacked()
        for b in range(run.num_rows):
            kept = max(int(state.num_tokens[b]) - untrusted, 0)
            for got, want in zip(stored, expected):
                np.testing.assert_allclose(got[:, b, :kept], want[:, b, :kept], rtol=1e-5, atol=1e-5)
    for b in range(run.num_rows):
        assert int(state.cache.lengths[b]) == int(state.num_tokens[b]) - 1


TEACHER_WIDTH = 128  # one compile for every teacher-forced sequence (prompt + output <= 128)


def teacher_logits(config: LlamaConfig, params, sequence: Sequence[int]) -> np.ndarray:
    """f32[len, V]: row i is the target's logits after sequence[: i + 1] (one forward pass)."""
    if len(sequence) > TEACHER_WIDTH:
        raise ValueError(f"sequence of {len(sequence)} tokens exceeds TEACHER_WIDTH {TEACHER_WIDTH}")
    padded = np.zeros((1, TEACHER_WIDTH), np.int32)
    padded[0, : len(sequence)] = sequence
    logits, _ = _forward(config, params, jnp.asarray(padded), config.init_cache(1, TEACHER_WIDTH))
    return np.asarray(logits)[0, : len(sequence)]


# ----------------------------------------------------------------------------
# Tie-aware greedy comparison (docs/design.md section 6), on top of specdec_jax.compare


def assert_greedy_equivalent(config, params, prompts, references, candidates, tol: float = 1e-3) -> float:
    """Raises AssertionError unless every divergence is a near-tie; returns the exact-match rate."""
    exact, rows = compare_rows(config, params, prompts, references, candidates, tol)
    bad = [(b, r) for b, r in enumerate(rows) if not r.ok]
    assert not bad, f"divergences outside near-ties (tol {tol}): {bad}; exact-match rate {exact:.2f}"
    return exact


# ----------------------------------------------------------------------------
# The oracle at alpha 1.0 driven by hand: every draft is the target's own greedy token

ORACLE_MAX_NEW = 38  # not a multiple of gamma + 1: the budget clips the drafts of the last round


@dataclasses.dataclass
class History:
    run: HandRun
    states: list  # DecodeState before round 0, after round 0, after round 1, ...
    drafted: list  # DecodeState of round r after its draft step (before its verify step)

    @property
    def proposals(self) -> list:
        """Proposal of round r (after draft_step's clipping)."""
        return [s.proposal for s in self.drafted]


@functools.cache
def oracle_all_accept_history() -> History:
    """RAGGED with the alpha = 1.0 oracle, gamma GAMMA, eos_id(), ORACLE_MAX_NEW, round by round."""
    run = prepare(RAGGED, oracle(1.0), gamma=GAMMA, eos=eos_id(), max_new_tokens=ORACLE_MAX_NEW)
    states, drafted = [run.state], []
    while bool(np.any(~np.asarray(run.state.done))) and len(drafted) < ORACLE_MAX_NEW:
        drafted.append(run.round())
        states.append(run.state)
    return History(run, states, drafted)


def truncated_reference(max_new: int) -> tuple[list[list[int]], list[str]]:
    """What plain decoding of RAGGED with eos_id() gives under a smaller budget (derived, no run)."""
    ref = reference()
    out = [t[:max_new] for t in ref.tokens]
    why = [r if len(t) <= max_new else "length" for t, r in zip(ref.tokens, ref.stop_reasons)]
    return out, why


def forced_rounds(drafter, schedule: Sequence[int], gammas: Sequence[int], max_new: int = MAX_NEW):
    """RAGGED with ``drafter`` under a shape policy over ``gammas``, one round per entry of ``schedule`` (a draft
    and verify shape index, `DecodeState.forced_shape`) until every row is done; returns (the run,
    [(choice, state before, after drafting, after the round) per round], states on the host)."""
    policy = ShapePolicy(tuple(gammas), (1.0,) * len(gammas), (0.0,) + (1.0,) * (len(gammas) - 1))
    run = engine.prepare(target(), RAGGED, drafter, policy=policy, max_new_tokens=max_new, eos_id=eos_id())
    hand = HandRun(run.spec, run.params, run.state, run.num_rows)
    rounds = []
    for choice in schedule:
        if bool(np.all(np.asarray(hand.state.done))):
            break
        before = host(hand.state)
        hand.state = hand.state.replace(forced_shape=jnp.array([choice, choice], jnp.int32))
        drafted = hand.round()
        rounds.append((choice, before, host(drafted), host(hand.state)))
    return hand, rounds


def host(state: engine.DecodeState) -> engine.DecodeState:
    """The state as numpy arrays (the PRNG key, which numpy cannot hold, is dropped)."""
    return jax.device_get(state.replace(key=None))


def assert_cli_drafts_as_plain(capsys, drafter: str, folder: str, gamma: int) -> None:
    """`specdec-jax generate` on tiny-random with ``--drafter drafter --draft-model folder`` prints the text
    plain decoding prints, and its tokens per round."""
    from specdec_jax.cli import main

    flags = ["generate", "--model", "tiny-random", "--raw", "--max-new-tokens", "6", "--prompt", "abcabc"]
    plain = main(flags)
    plain_out = capsys.readouterr().out
    code = main([*flags, "--drafter", drafter, "--draft-model", folder, "--gamma", str(gamma)])
    spec_out = capsys.readouterr().out
    assert plain == code == 0 and "tokens/round" in spec_out
    assert plain_out.splitlines()[0] == spec_out.splitlines()[0], (plain_out, spec_out)

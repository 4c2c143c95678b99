"""Grammar constraints inside the decoding loop (docs/constraints.md).

Greedy: constrained speculative decoding equals constrained plain decoding, for every drafter
(chains and trees, point masses and sampled q), on a ragged batch whose rows have different
constraints or none, and every output fully matches its regex or validates against its schema
(`re.fullmatch`, `jsonschema`). Sampling: the law of whole constrained sequences on a toy
vocabulary matches the exact constrained law, computed with the `regex` module alone (a token is
allowed iff some continuation that fits the budget makes the text a whole match), by chi-square;
a verifier that masks every position with the row's state before the round instead of the state
along the candidate's own path fails it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import regex
from pydivsufsort import divsufsort

import engine_helpers as H
from specdec_jax import engine, grammar
from specdec_jax.audit import chi_square, continuation_codes, continuation_logits, noisy_copy
from specdec_jax.constraints import Constraint, build_tables, compile_constraint
from specdec_jax.datastore import SEP, Datastore
from specdec_jax.drafters import (EagleConfig, EagleDrafter, MedusaConfig, MedusaDrafter, ModelDrafter,
                                  RetrievalDrafter)
from specdec_jax.drafters.eagle import init_eagle
from specdec_jax.engine import ShapePolicy, round as engine_round
from specdec_jax.models import LlamaConfig, random_llama
from specdec_jax.sampling import SamplingParams
from specdec_jax.token_tree import TreeShape
from test_engine_law import FULL_N, N, law_cases

DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
WORDS = r"[a-z]{2,6}( [a-z]{2,6}){1,4}\."
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ROW_CONSTRAINTS = [Constraint(regex=DATE), Constraint(regex=WORDS), None, Constraint(json_schema=json.dumps(PERSON))]


@functools.cache
def row_tables():
    tok = H.target().tokenizer
    return [None if c is None else compile_constraint(c, tok) for c in ROW_CONSTRAINTS]


def text_of(tokens) -> str:
    """The output's text, its stop token left out."""
    tok = H.target().tokenizer
    return tok.decode([t for t in tokens if t not in tok.stop_ids])


def assert_valid(tokens, constraint: Constraint | None) -> None:
    text = text_of(tokens)
    if constraint is None:
        return
    if constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), (constraint.regex, text)
    else:
        jsonschema.validate(json.loads(text), json.loads(constraint.json_schema))


def constrained(drafter=None, gamma=None, **options):
    return engine.generate(H.target(), H.RAGGED, drafter, gamma=gamma, max_new_tokens=H.MAX_NEW,
                           stop_ids=H.target().tokenizer.stop_ids, grammars=row_tables(), **options)


@functools.cache
def constrained_plain():
    return constrained()


def eagle_head(tree: TreeShape | None = None) -> EagleDrafter:
    cfg = H.target().config
    head = EagleConfig(cfg.hidden_size, cfg.vocab_size, 64, 2, 1, 32)
    return EagleDrafter(head, init_eagle(head, jax.random.key(5)), tree=tree)


def medusa_heads() -> MedusaDrafter:
    cfg, rng = H.target().config, np.random.default_rng(5)
    params = {"w": (rng.standard_normal((3, cfg.hidden_size, cfg.hidden_size)) / np.sqrt(cfg.hidden_size)).astype(
        np.float32), "b": rng.standard_normal((3, cfg.hidden_size)).astype(np.float32)}
    return MedusaDrafter(MedusaConfig(cfg.hidden_size, cfg.vocab_size, 3), params)


def retrieval_of_the_outputs() -> RetrievalDrafter:
    """A datastore holding the constrained outputs themselves: its drafts are mostly right."""
    tokens = np.asarray([t for out in constrained_plain().tokens for t in out + [SEP]], np.int32)
    store = Datastore(tokens, np.asarray(divsufsort(tokens), np.int32), {"sources": ["outputs"], "tokenizer": "bytes"})
    return RetrievalDrafter.from_datastore(store)


DRAFTERS = {
    "ngram": (H.ngram, 4),
    "retrieval": (retrieval_of_the_outputs, 4),
    "medusa": (medusa_heads, 3),
    "draft-model": (H.model_drafter, 4),
    "oracle": (lambda: H.oracle(0.8), 4),
    "eagle": (eagle_head, 3),
    "ngram-trie": (H.ngram_trie, None),
    "decoy-tree-of-oracle": (lambda: H.decoy_tree(H.oracle(0.9)), None),
    "eagle-tree": (lambda: eagle_head(TreeShape(nodes=6, depth=3, topk=2)), None),
}


def test_constrained_plain_outputs_match_and_the_free_row_is_unchanged():
    """Every constrained row matches (regex) or validates (schema); rows end on a stop token, on a whole
    match nothing may extend, or on the budget; the row without a constraint is the unconstrained run's."""
    out = constrained_plain()
    for tokens, c in zip(out.tokens, ROW_CONSTRAINTS):
        assert_valid(tokens, c)
    free = engine.generate(H.target(), H.RAGGED, max_new_tokens=H.MAX_NEW, stop_ids=H.target().tokenizer.stop_ids)
    assert out.tokens[2] == free.tokens[2] and out.stop_reasons[2] == free.stop_reasons[2]
    assert out.stop_reasons[0] == "grammar" and len(out.tokens[0]) == 10  # a date: ten bytes, then nothing fits
    assert set(out.stop_reasons) <= {"eos", "grammar", "length"}


# By default: a context-fixed chain (n-gram), a drafter with its own law (draft model), a static tree
# (trie) and a dynamic tree (EAGLE); the drafters that share those code paths are in the slow step.
DEFAULT_DRAFTERS = ("ngram", "draft-model", "ngram-trie", "eagle-tree")


@pytest.mark.parametrize("name", [n if n in DEFAULT_DRAFTERS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in DRAFTERS])
def test_greedy_constrained_spec_equals_constrained_plain(name):
    make, gamma = DRAFTERS[name]
    out, ref = constrained(make(), gamma), constrained_plain()
    assert out.tokens == ref.tokens and out.stop_reasons == ref.stop_reasons
    assert out.metrics.draft_tokens > 0
    if name in ("ngram", "retrieval", "oracle", "decoy-tree-of-oracle"):  # drafts that are often right were accepted
        assert out.metrics.accepted_tokens > 0 and out.metrics.rounds < ref.metrics.rounds


def test_greedy_constrained_spec_under_a_shape_policy_equals_plain():
    """gamma "auto" (a fixed policy): the rounds' shapes change, the outputs do not."""
    policy = ShapePolicy((0, 1, 3), (1.0, 1.2, 1.5), (0.0, 0.1, 0.3), prior=0.9)
    out = constrained(H.oracle(0.8), policy=policy)
    assert out.tokens == constrained_plain().tokens


def test_the_budget_ends_every_row_on_a_whole_match():
    """A regex whose matches are long (a digit run of any length, then "!"): with 12 tokens, every row
    still ends on a whole match, whatever the model would rather write."""
    tables = compile_constraint(Constraint(regex=r"[0-9]+ ?[a-z]*!"), H.target().tokenizer)
    for drafter, gamma in ((None, 0), (H.ngram(), 4)):
        out = engine.generate(H.target(), H.RAGGED, drafter, gamma=gamma, max_new_tokens=12, grammars=tables,
                              sampling=SamplingParams(temperature=1.0), seed=3)
        for tokens in out.tokens:
            assert re.fullmatch(r"[0-9]+ ?[a-z]*!", text_of(tokens)), text_of(tokens)


@pytest.mark.slow  # by default the exact constrained law (toy) and the CLI's validated outputs guard sampling
@pytest.mark.parametrize("drafter", ["draft-model", "ngram-trie"])
def test_sampled_constrained_rows_all_validate(drafter):
    """256 sampled rows (temperature 1) per constraint through speculation: every one matches."""
    make, gamma = DRAFTERS[drafter]
    prompts = [H.RAGGED[i % 4] for i in range(256)]
    for constraint in (Constraint(regex=WORDS), Constraint(json_schema=json.dumps(PERSON))):
        tables = compile_constraint(constraint, H.target().tokenizer)
        out = engine.generate(H.target(), prompts, make(), gamma=gamma, max_new_tokens=H.MAX_NEW, grammars=tables,
                              stop_ids=H.target().tokenizer.stop_ids, sampling=SamplingParams(temperature=1.0))
        for tokens in out.tokens:
            assert_valid(tokens, constraint)
        assert len({tuple(t) for t in out.tokens}) > 100  # sampled, not one output repeated


def test_bad_constraints_are_refused_before_anything_runs():
    tok = H.target().tokenizer
    long = compile_constraint(Constraint(regex="[0-9]{50}"), tok)
    with pytest.raises(ValueError, match="shortest match is 50 tokens, more than max_new_tokens"):
        engine.generate(H.target(), H.RAGGED[:1], max_new_tokens=8, grammars=long)
    empty = compile_constraint(Constraint(regex="(|[0-9]{50})"), tok)
    with pytest.raises(ValueError, match="matches only the empty text"):
        engine.generate(H.target(), H.RAGGED[:1], max_new_tokens=8, grammars=empty)
    with pytest.raises(ValueError, match="got 1 grammars for 2 prompts"):
        engine.generate(H.target(), H.RAGGED[:2], max_new_tokens=8, grammars=[long])


# ------------------------------------------------------------------------------------ the law

V, NEW, SIGNIFICANCE = 6, 4, 1e-4
LETTERS = [b"a", b"b", b"c", b"d", b"e"]  # tokens 0..4; token 5 is the stop token (no bytes)
STOP_TOKEN = 5
LAW_PATTERN = r"(a|b[cd]|c[a-e]|d[ab]e?|e)+"  # what may follow depends on the token before
PROMPT = [1, 2, 3, 1, 2]
CONFIG = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=8)


@functools.cache
def toy_target():
    return random_llama(CONFIG, 7)


@functools.cache
def toy_tables():
    return build_tables(LAW_PATTERN, [*LETTERS, b""], (STOP_TOKEN,))


def reference_allowed(prefix: tuple[int, ...], remaining: int) -> np.ndarray:
    """bool[V]: the tokens allowed after ``prefix`` when ``remaining`` more tokens may follow: a letter iff
    some at most ``remaining`` letters after it make a whole match, the stop token iff the text is one."""
    text = "".join(LETTERS[t].decode() for t in prefix if t != STOP_TOKEN)
    ok = [any(regex.fullmatch(LAW_PATTERN, text + LETTERS[t].decode() + "".join(c))
              for k in range(remaining + 1) for c in itertools.product("abcde", repeat=k)) for t in range(5)]
    return np.array(ok + [regex.fullmatch(LAW_PATTERN, text) is not None])


@functools.cache
def constrained_law() -> np.ndarray:
    """f64[V^NEW]: the exact law of the constrained continuations (temperature 1)."""
    seqs, logits = continuation_logits(CONFIG, toy_target().params(), PROMPT, NEW)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    law = np.ones(len(seqs))
    masks = functools.cache(reference_allowed)
    for i in range(NEW):
        for row, seq in enumerate(seqs[:, len(PROMPT):]):
            if law[row] == 0:  # a prefix the constraint refused
                continue
            allowed = masks(tuple(seq[:i]), NEW - i - 1)
            p = probs[row, i] * allowed
            law[row] *= p[seq[i]] / p.sum()
    assert abs(law.sum() - 1) < 1e-9
    return law


def toy_drafter(name: str):
    draft = noisy_copy(toy_target())
    chain = ModelDrafter(CONFIG, draft.params())
    return chain if name == "model" else H.DecoyTree(chain, V, draft.params())


def constrained_samples(name: str, gamma, seed: int, capacity: int = 16, rows: int = N):
    out = engine.generate(toy_target(), [PROMPT] * rows, toy_drafter(name), gamma=gamma, max_new_tokens=NEW,
                          sampling=SamplingParams(temperature=1.0), seed=seed, capacity=capacity,
                          grammars=toy_tables())
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (rows, NEW)
    return continuation_codes(tokens, V), out.metrics


def test_the_reference_mask_is_the_tables_mask():
    """The law's reference masks (the `regex` module) equal the device tables' along every prefix."""
    tables = grammar.stack_grammars([toy_tables()], V)
    rows = grammar.RowGrammar(tables, tables.initial[1:], jnp.asarray([NEW]))
    path_states = jax.jit(grammar.path_states)  # one compile per prefix length, not one per prefix
    for length in range(NEW):
        for prefix in itertools.product(range(V), repeat=length):
            if not all(reference_allowed(prefix[:i], NEW - i - 1)[t] for i, t in enumerate(prefix)):
                continue  # a prefix the law never reaches
            expected = reference_allowed(prefix, NEW - length - 1)
            states = path_states(tables, rows.states, jnp.asarray([prefix], jnp.int32))[:, -1]
            got = np.asarray(rows.mask(states, length))[0]
            assert got.tolist() == expected.tolist(), prefix


@pytest.mark.parametrize("name, gamma, seed, rows", law_cases([("chain", "model", 3, 31, True),
                                                               ("tree", "decoy-tree", None, 32, False)]))
def test_constrained_spec_sampling_follows_the_exact_constrained_law(name, gamma, seed, rows):
    codes, metrics = constrained_samples(name, gamma, seed, rows=rows)
    stat, _, pvalue = chi_square(np.bincount(codes, minlength=V**NEW), constrained_law())
    assert pvalue > SIGNIFICANCE, f"chi2 {stat:.1f}, p = {pvalue:.2e}"
    assert metrics.accepted_tokens > rows / 10 and metrics.accepted_tokens < metrics.draft_tokens, metrics


@pytest.mark.slow  # suite time: a check of the check
def test_a_verifier_ignoring_the_candidates_grammar_states_fails(monkeypatch):
    """Power: masking every verified position with the row's state before the round (not the state along
    the drafts before it) gives another law, which the same test rejects by far."""
    def stale_masks(state, rows):
        if rows is None:
            return None
        width = state.proposal.drafts.shape[1] + 1
        return rows.mask(jnp.broadcast_to(rows.states[:, None], (rows.states.shape[0], width)), jnp.arange(width))

    monkeypatch.setattr(engine_round, "verify_masks", stale_masks)
    try:
        codes, _ = constrained_samples("model", 3, 31, capacity=32, rows=FULL_N)  # another program than the exact run's
    finally:
        jax.clear_caches()
    _, _, pvalue = chi_square(np.bincount(codes, minlength=V**NEW), constrained_law())
    assert pvalue < 1e-30


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_sampling_drafter_draws_only_tokens_its_grammar_allows(temperature):
    """The draft model's q is masked along its own drafts: every draft of a constrained row is allowed
    where it stands (a random draft model left to itself writes almost no date or sentence)."""
    run = engine.prepare(H.target(), H.RAGGED, H.model_drafter(), gamma=4, max_new_tokens=H.MAX_NEW,
                         sampling=SamplingParams(temperature=temperature), grammars=row_tables())
    drafted = engine.draft_step(run.spec, run.params, run.state)
    states = grammar.path_states(run.params.grammar, drafted.grammar_state, drafted.proposal.drafts)
    assert (np.asarray(drafted.proposal.num_draft) == 4).all()
    assert (np.asarray(states) != grammar.DEAD).all()


@pytest.mark.parametrize("name", ["eagle-tree", pytest.param("draft-model-tree", marks=pytest.mark.slow)])
def test_a_dynamic_tree_holds_only_allowed_nodes_where_the_grammar_allows_enough(name):
    """A dynamic tree ranks each node's children by the drafter's law masked along the node's own path:
    every node whose parent's state allows at least topk tokens is allowed itself."""
    shape = TreeShape(nodes=6, depth=3, topk=2)
    drafter = eagle_head(shape) if name == "eagle-tree" else dataclasses.replace(H.model_drafter(), tree=shape)
    run = engine.prepare(H.target(), H.RAGGED, drafter, max_new_tokens=H.MAX_NEW, grammars=row_tables())
    state = run.state
    for _ in range(3):  # a few rounds in, the rows stand in different states
        drafted = engine.draft_step(run.spec, run.params, state)
        tables, proposal = run.params.grammar, drafted.proposal
        states = np.asarray(grammar.path_states(tables, drafted.grammar_state, proposal.drafts, proposal.parents))
        parents = np.asarray(proposal.parents)
        parent_states = np.where(parents >= 0, np.take_along_axis(states, np.maximum(parents, 0) + 1, axis=1),
                                 states[:, :1])
        choices = np.asarray(grammar.allowed(tables, jnp.asarray(parent_states))).sum(-1)  # i64[B,G]
        enough = (choices >= shape.topk) & (parent_states != grammar.DEAD)
        assert (states[:, 1:][enough] != grammar.DEAD).all()
        assert enough[[0, 1, 3]].any()  # the constrained rows were checked
        state = engine.verify_step(run.spec, run.params, drafted)

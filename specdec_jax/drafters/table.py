"""The table of drafters: every `--drafter` NAME, how a run builds it and what it asks of the run settings.

One `DrafterSpec` per name; the CLI's help, the run settings' checks
(`config.RunConfig`), `runner.build_drafter`, `bench` (its transformers peer)
and `demo` read it, and nothing else names the drafters. ``none`` (plain
decoding, `PLAIN`) is no entry: it builds no drafter.

Adding a drafter (docs/design.md section 9) is a module with the drafter (a
frozen dataclass on `base.DrafterBase`) and one `register_drafter` call: the
built-in ones are registered at the end of this module, another package's
where it is imported. The builders import their drafter's module when called,
so reading the table loads no model code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

PLAIN = "none"  # --drafter none: plain decoding
PEERS = ("lookup", "assisted")  # transformers' counterparts `bench --peer hf` can time


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """One drafter of the table.

    build(cfg, target, mesh) -> Drafter: from the run settings (`config.RunConfig`), the loaded
      target (`models.LoadedModel`) and the mesh the run's models are placed on (None: one device).
    help: one line for `--help`.
    needs: run settings (flat keys) it cannot draft without, e.g. ``draft_model``.
    trees: it drafts token trees (the ``tree_*`` settings); else chains only.
    settings: the drafter settings (flat keys of `config.DrafterSettings`, or ``tree_choices``) it
      reads; one that is off by default (0, empty, None) is refused with a drafter that does not read it.
    peer: transformers' counterpart `bench --peer hf` times beside it: "lookup" (prompt-lookup
      decoding) or "assisted" (assisted generation with the same ``draft_model``).
    trained_kind: the `train-draft --kind` whose output it drafts with (None: it is not trained).
    """

    name: str
    build: Callable[[Any, Any, Any], Any]
    help: str
    needs: tuple[str, ...] = ()
    trees: bool = False
    settings: tuple[str, ...] = ()
    peer: str = "lookup"
    trained_kind: str | None = None

    def __post_init__(self):
        if self.peer not in PEERS:
            raise ValueError(f"drafter {self.name!r}: peer must be one of {', '.join(PEERS)}, got {self.peer!r}")

    @property
    def needs_draft_model(self) -> bool:
        """It drafts with ``--draft-model`` (a draft model or a trained head folder)."""
        return "draft_model" in self.needs


_TABLE: dict[str, DrafterSpec] = {}


def register_drafter(name: str, build: Callable[[Any, Any, Any], Any], help: str, **options) -> DrafterSpec:
    """Adds ``--drafter name`` (``options``: the other fields of `DrafterSpec`); a name already in the
    table, or ``none``, is a ValueError."""
    if name == PLAIN or name in _TABLE:
        raise ValueError(f"drafter {name!r} is taken: choose another name (taken: {', '.join(drafter_names())})")
    _TABLE[name] = spec = DrafterSpec(name, build, help, **options)
    return spec


def unregister_drafter(name: str) -> None:
    """Removes a drafter `register_drafter` added."""
    drafter_spec(name)
    del _TABLE[name]


def drafter_spec(name: str) -> DrafterSpec:
    """The entry of ``--drafter name``; an unknown name is a ValueError listing the known ones."""
    if name not in _TABLE:
        raise ValueError(f"unknown drafter {name!r} (known: {', '.join(drafter_names())})")
    return _TABLE[name]


def drafters() -> tuple[DrafterSpec, ...]:
    """Every entry, in the order they were registered."""
    return tuple(_TABLE.values())


def drafter_names() -> tuple[str, ...]:
    """Every `--drafter` value: ``none``, then the table's names."""
    return (PLAIN, *_TABLE)


def names_where(test: Callable[[DrafterSpec], bool]) -> list[str]:
    """The names of the entries ``test`` holds for (e.g. ``lambda s: s.trees``)."""
    return [spec.name for spec in _TABLE.values() if test(spec)]


# ------------------------------------------------------------------------------------ the built-in drafters


def _lookup(cfg, tree=None):
    from specdec_jax.drafters.ngram import NgramDrafter

    return NgramDrafter(max_n=cfg.drafting.ngram_max, min_n=cfg.drafting.ngram_min, tree=tree)


def _ngram(cfg, target, mesh):
    return _lookup(cfg, cfg.tree_shape)


def _retrieval(cfg, target, mesh):  # one device only: RetrievalDrafter.check refuses a mesh
    from specdec_jax.datastore import OUTPUTS, OUTPUTS_CAPACITY, load_datastore
    from specdec_jax.drafters.retrieval import RetrievalDrafter

    sources = cfg.drafting.datastore
    fixed = [s for s in sources if s != OUTPUTS]
    store = load_datastore(fixed, target.tokenizer) if fixed else None
    return RetrievalDrafter.from_datastore(store, outputs=OUTPUTS_CAPACITY if OUTPUTS in sources else 0,
                                           lookup=_lookup(cfg), tree=cfg.tree_shape)


def _draft_model(cfg, target, mesh):
    from specdec_jax.drafters.model import ModelDrafter
    from specdec_jax.drafters.published import head_kind
    from specdec_jax.models import load_model
    from specdec_jax.sharding import place_model
    from specdec_jax.token_ranking import ranked_ids

    held = head_kind(cfg.draft_model)
    if held is not None:
        raise ValueError(f"{cfg.draft_model} holds a {held[0]} head, not a draft model: use --drafter {held[1]}")
    draft = load_model(cfg.draft_model, dtype=cfg.dtype)
    if cfg.drafting.draft_vocab:
        ranking = ranked_ids(cfg.drafting.draft_vocab_source, draft.tokenizer, draft.config.vocab_size)
        draft = draft.with_output_vocab(cfg.drafting.draft_vocab, ranking)
    if mesh is not None:
        draft = place_model(draft, mesh, "the draft model")
    return ModelDrafter(draft.config, draft.model.params(), tree=cfg.tree_shape,
                        stop_below=cfg.drafting.draft_confidence)


def _oracle(cfg, target, mesh):
    from specdec_jax.drafters.model import oracle_drafter

    return oracle_drafter(target.config, target.model.params(), cfg.drafting.oracle_alpha)


def _head(cfg, target, mesh):
    """A head folder of the drafter's kind: this project's trained heads (`drafters.heads`) or published
    ones (`drafters.published`: speculators and SafeAILab EAGLE-3, Medusa-1)."""
    from specdec_jax.drafters.published import load_drafter_folder

    drafter = load_drafter_folder(cfg.draft_model, kind=cfg.drafter, target=target)
    stop = {"stop_below": cfg.drafting.draft_confidence} if cfg.drafting.draft_confidence else {}  # EAGLE's chains
    return dataclasses.replace(drafter, tree=cfg.tree_shape, **stop)


def _dflash(cfg, target, mesh):
    """A z-lab or speculators DFlash folder (`drafters.published`), at ``--dflash-block`` when set; chains only."""
    from specdec_jax.drafters.published import load_drafter_folder

    drafter = load_drafter_folder(cfg.draft_model, kind="dflash", target=target)
    return drafter.with_block(cfg.drafting.dflash_block) if cfg.drafting.dflash_block else drafter


register_drafter("ngram", _ngram, "prompt lookup, the continuation of the latest earlier occurrence of the "
                 "context's last n tokens", trees=True, settings=("ngram_max", "ngram_min"))
register_drafter("retrieval", _retrieval, "the n-gram lookup in a token datastore (--datastore) and the context",
                 needs=("datastore",), trees=True, settings=("ngram_max", "ngram_min", "datastore"))
register_drafter("draft-model", _draft_model, "a smaller model of the target's vocabulary (--draft-model)",
                 needs=("draft_model",), trees=True, peer="assisted", trained_kind="model",
                 settings=("draft_vocab", "draft_vocab_source", "draft_confidence"))
register_drafter("oracle", _oracle, "proposes the target's own token with probability --oracle-alpha (for "
                 "experiments)", settings=("oracle_alpha",))
register_drafter("eagle", _head, "an EAGLE head on the target's hidden states (a trained head folder, or a "
                 "published EAGLE-3 head of speculators or SafeAILab: --draft-model)", needs=("draft_model",),
                 trees=True, settings=("draft_confidence",), trained_kind="eagle")
register_drafter("medusa", _head, "Medusa heads on the target's last hidden state (a trained head folder, or "
                 "FasterDecoding's Medusa-1 heads: --draft-model)", needs=("draft_model",), trees=True,
                 settings=("tree_choices",), trained_kind="medusa")
register_drafter("dflash", _dflash, "a DFlash block drafter on the target's hidden states, one pass per block (a z-lab or "
                 "speculators DFlash folder: --draft-model)", needs=("draft_model",), settings=("dflash_block",),
                 trained_kind="dflash")

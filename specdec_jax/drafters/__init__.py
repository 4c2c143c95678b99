"""Drafters: n-gram prompt lookup, a draft model, and the oracle (for experiments)."""

from specdec_jax.drafters.base import DraftContext, Drafter, Proposal
from specdec_jax.drafters.model import ModelDrafter, oracle_drafter
from specdec_jax.drafters.ngram import NgramDrafter

__all__ = ["DraftContext", "Drafter", "ModelDrafter", "NgramDrafter", "Proposal", "oracle_drafter"]

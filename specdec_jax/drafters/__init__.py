"""Drafters: n-gram prompt lookup, retrieval from a token datastore, a draft model, EAGLE and Medusa heads on the target's features,
and the oracle (for experiments)."""

from specdec_jax.drafters.base import DraftContext, Drafter, DrafterBase, Proposal
from specdec_jax.drafters.eagle import EagleConfig, EagleDrafter
from specdec_jax.drafters.heads import load_head
from specdec_jax.drafters.medusa import MedusaConfig, MedusaDrafter
from specdec_jax.drafters.model import ModelDrafter, oracle_drafter
from specdec_jax.drafters.ngram import NgramDrafter
from specdec_jax.drafters.retrieval import RetrievalDrafter

__all__ = ["DraftContext", "Drafter", "DrafterBase", "EagleConfig", "EagleDrafter", "MedusaConfig", "MedusaDrafter",
           "ModelDrafter", "NgramDrafter", "Proposal", "RetrievalDrafter", "load_head", "oracle_drafter"]

"""Drafters: n-gram prompt lookup, a draft model, EAGLE and Medusa heads on the target's features,
and the oracle (for experiments)."""

from specdec_jax.drafters.base import DraftContext, Drafter, DrafterBase, Proposal
from specdec_jax.drafters.eagle import EagleConfig, EagleDrafter
from specdec_jax.drafters.heads import load_head
from specdec_jax.drafters.medusa import MedusaConfig, MedusaDrafter
from specdec_jax.drafters.model import ModelDrafter, oracle_drafter
from specdec_jax.drafters.ngram import NgramDrafter

__all__ = ["DraftContext", "Drafter", "DrafterBase", "EagleConfig", "EagleDrafter", "MedusaConfig", "MedusaDrafter",
           "ModelDrafter", "NgramDrafter", "Proposal", "load_head", "oracle_drafter"]

"""Drafters: n-gram prompt lookup, retrieval from a token datastore, a draft model, EAGLE (EAGLE-3 included) and
Medusa heads on the target's features, DFlash block drafting, and the oracle (for experiments).

The protocol (`DraftContext`, `Drafter`, `DrafterBase`, `Proposal`, `drafters.base`) and the table of
drafters (`register_drafter`, `drafters.table`) load with the package; each drafter's class loads from its
module when first named here, so importing the protocol loads no model code.
"""

import importlib

from specdec_jax.drafters.base import DraftContext, Drafter, DrafterBase, Proposal
from specdec_jax.drafters.table import DrafterSpec, drafter_spec, register_drafter, unregister_drafter

LAZY = {  # name -> the module that defines it
    "EagleConfig": "eagle", "EagleDrafter": "eagle", "MedusaConfig": "medusa", "MedusaDrafter": "medusa",
    "ModelDrafter": "model", "oracle_drafter": "model", "NgramDrafter": "ngram", "RetrievalDrafter": "retrieval",
    "load_head": "heads", "Eagle3Config": "eagle3", "Eagle3Drafter": "eagle3", "load_drafter_folder": "published",
    "DFlashConfig": "dflash", "DFlashDrafter": "dflash",
}

__all__ = ["DraftContext", "Drafter", "DrafterBase", "DrafterSpec", "Proposal", "drafter_spec", "register_drafter",
           "unregister_drafter", *LAZY]


def __getattr__(name: str):
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{LAZY[name]}"), name)

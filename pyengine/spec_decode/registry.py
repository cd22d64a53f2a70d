"""The speculative methods by name: adding one is a module with its Proposer and a line
here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyengine.spec_decode.draft_model import DraftModelProposer
from pyengine.spec_decode.ngram import NgramProposer
from pyengine.spec_decode.proposer import Proposer
from pyengine.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    from pyengine.spec_decode.config import SpeculativeConfig

PROPOSERS: dict[str, type[Proposer]] = {
    proposer.name: proposer for proposer in (NgramProposer, SuffixProposer, DraftModelProposer)
}


def create_proposer(spec: SpeculativeConfig) -> Proposer:
    """The proposer of speculative_config's method (SpeculativeConfig checked it)."""
    return PROPOSERS[spec.method](spec)

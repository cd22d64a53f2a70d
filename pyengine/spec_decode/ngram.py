"""Prompt lookup (method ngram): a request's drafts are the tokens that followed the last
earlier occurrence of its latest tokens, in its prompt or its output (the scheduler's
Scheduler.propose_ngram_drafts, in C++)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyengine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from pyengine import Scheduler


class NgramProposer(Proposer):
    name = "ngram"

    def propose(self, scheduler: Scheduler) -> None:
        spec = self.spec
        scheduler.propose_ngram_drafts(
            spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens
        )

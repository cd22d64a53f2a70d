"""Suffix decoding (method suffix): drafts from suffix trees of the request's own tokens
and of earlier requests' outputs (cpp/include/pyengine/suffix_proposer.h), which the
scheduler keeps once enabled."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyengine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from pyengine import Scheduler


class SuffixProposer(Proposer):
    name = "suffix"

    def configure(self, scheduler: Scheduler) -> None:
        spec = self.spec
        scheduler.enable_suffix_drafts(
            spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob,
            spec.num_speculative_tokens,
        )

    def propose(self, scheduler: Scheduler) -> None:
        scheduler.propose_suffix_drafts()

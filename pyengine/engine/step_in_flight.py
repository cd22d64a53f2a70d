"""A step the engine core has handed the executor and whose tokens are still to come:
what the core keeps of it, and its drafts, which it applies once they are known."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pyengine.engine.structured_output import StepGrammar
from pyengine.executor.abstract import Pending
from pyengine.step_values import ExecuteOutput, SampledTokens


@dataclass
class StepInFlight:
    """A step submitted to the executor whose tokens are still to come."""

    virtual_engine: int
    row_ids: list[str]
    sampled_row_ids: list[str]
    scored: list[tuple[str, int]]  # (request id, prompt position) per prompt-logprob row
    cached: dict[str, tuple[int, int]]  # as EngineCoreOutput.num_cached_tokens
    num_sampled: int
    # Speculative decoding: each row's draft tokens (empty where none), and which rows
    # sample; None where the step verifies none.
    drafts: list[np.ndarray] | None = None
    is_sampling: np.ndarray | None = None
    # Whether the drafts are the worker's draft model's, made in the step (until then,
    # `drafts` holds their placeholders).
    drafts_in_step: bool = False
    # (request index, drafts before it) of each sampled row
    places: list[tuple[int, int]] = field(default_factory=list)
    grammar: StepGrammar | None = None  # its constrained rows' grammars
    executed: Pending[ExecuteOutput] | None = None
    # None until it is asked for: where the masks follow a draft model's drafts, once
    # the step ran.
    sampled: Pending[SampledTokens] | None = None

    def take_drafts(self, made: np.ndarray) -> None:
        """The drafts a draft model made in the step (int32, row after row), in place of
        their placeholders: the step's verification's, and its grammar's (the
        scheduler's are the core's to set)."""
        assert self.drafts is not None
        ends = np.cumsum([len(d) for d in self.drafts])
        self.drafts = np.split(made, ends[:-1]) if len(ends) else []
        if self.grammar is not None:
            self.grammar.set_drafts(self.row_drafts())

    def first_draft_masks(self, grammar: StepGrammar) -> dict[int, np.ndarray]:
        """The allowed tokens of each constrained request's first draft, by its index:
        its row before its drafts'."""
        assert self.drafts is not None
        rows = [k for k, (request, j) in enumerate(self.places)
                if not j and k in grammar.matchers and len(self.drafts[request])]  # fmt: skip
        masks = grammar.masks(rows)
        return {self.places[k][0]: masks[n] for n, k in enumerate(rows)}

    def row_drafts(self) -> dict[int, list[int]]:
        """The drafts each constrained sampled row after some follows, by its index (the
        grammar's rows: the others' are never asked for)."""
        assert self.drafts is not None and self.grammar is not None
        matchers = self.grammar.matchers
        return {k: self.drafts[request][:j].tolist()
                for k, (request, j) in enumerate(self.places) if j and k in matchers}  # fmt: skip

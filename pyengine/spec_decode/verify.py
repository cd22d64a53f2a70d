"""Verification of a step's draft tokens against the target's own tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecDecodeStats:
    """Counts since the engine started (vLLM's spec_decode_* counters)."""

    num_drafts: int = 0  # rows that verified draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[j]: drafts accepted at place j of a row's proposal
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafts: list[np.ndarray], counts: np.ndarray) -> None:
        """A step's drafts (per row) and its rows' new-token counts (Scheduler.update's)."""
        for proposed, count in zip(drafts, counts.tolist(), strict=True):
            if len(proposed) == 0 or count == 0:
                continue
            accepted = count - 1
            self.num_drafts += 1
            self.num_draft_tokens += len(proposed)
            self.num_accepted_tokens += accepted
            if len(self.accepted_per_position) < len(proposed):
                self.accepted_per_position += [0] * (
                    len(proposed) - len(self.accepted_per_position)
                )
            for j in range(accepted):
                self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying row gains in a step: its accepted drafts and one more."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def accept_drafts(
    chosen: np.ndarray, is_sampling: np.ndarray, drafts: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's new tokens: the target's own token at its last token and after each
    draft (chosen: int32, one per logits row, a row's 1 + its drafts in turn), kept while
    the drafts equal them, and one more. Returns the tokens, flat, and each row's count
    (0 for a row that does not sample), as Scheduler.update takes them.

    Each logits row's token is the sampler's: the argmax for greedy rows, so the tokens
    are exactly those of no speculation; for sampled rows a draw from the target's
    processed distribution at that place. For drafts proposed with certainty (one-hot q,
    every proposer here) that is rejection sampling exactly: the draft x is kept with
    probability p(x), and otherwise the token drawn is one of p without x, normalized
    (tests/helpers/rejection.py has the rule for any q)."""
    tokens: list[np.ndarray] = []
    counts = np.zeros(len(is_sampling), dtype=np.int32)
    at = 0
    for row in np.flatnonzero(is_sampling):
        proposed = drafts[row]
        k = len(proposed)
        target = chosen[at : at + k + 1]
        at += k + 1
        mismatch = np.flatnonzero(proposed != target[:k])
        accepted = int(mismatch[0]) if len(mismatch) else k
        tokens.append(target[: accepted + 1])
        counts[row] = accepted + 1
    if at != len(chosen):
        raise ValueError(f"accept_drafts: {len(chosen)} chosen tokens for {at} logits rows")
    flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32)
    return flat.astype(np.int32, copy=False), counts

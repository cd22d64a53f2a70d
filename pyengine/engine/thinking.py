"""A thinking row's reasoning, while it lasts (SamplingParams.thinking_end_token_ids):
the engine core follows each of the row's tokens until they end with the thinking's
end. Until then its structured output's matcher sleeps (the grammar constrains the
answer, not the reasoning), and with max_thinking_tokens, once that many tokens of
reasoning are written, the end's tokens are forced one by one (each row's next token
allowed by a one-token mask), so that the answer comes within the budget."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Thinking:
    end: tuple[int, ...]  # the tokens that end the reasoning
    budget: int | None  # tokens of reasoning at most (None: no bound)
    count: int = 0  # tokens of reasoning so far, the end's not counted
    recent: list[int] = field(default_factory=list)  # the last len(end) tokens
    ended: bool = False

    def accept(self, token: int) -> None:
        """Follows the row's next token (nothing once the reasoning has ended)."""
        if self.ended:
            return
        self.recent = [*self.recent, token][-len(self.end) :]
        if tuple(self.recent) == self.end:
            self.ended = True
        elif self.forced_index() is None:
            self.count += 1

    def forced_index(self) -> int | None:
        """Which of the end's tokens the next one must be, once the budget is spent
        (after those of it already written); None while the row may write freely."""
        if self.ended or self.budget is None or self.count < self.budget:
            return None
        written = _prefix_written(self.recent, self.end)
        return written

    def forced_mask(self, mask_words: int) -> np.ndarray | None:
        """The next token's bitmask (int32 words) where it is forced; None otherwise."""
        index = self.forced_index()
        if index is None:
            return None
        token = self.end[index]
        mask = np.zeros(max(mask_words, token // 32 + 1), dtype=np.uint32)
        mask[token // 32] = np.uint32(1) << np.uint32(token % 32)
        return mask.view(np.int32)


def _prefix_written(recent: list[int], end: tuple[int, ...]) -> int:
    """How many of end's first tokens the recent tokens end with (the longest such
    prefix, shorter than the whole end)."""
    for size in range(min(len(recent), len(end) - 1), 0, -1):
        if tuple(recent[-size:]) == end[:size]:
            return size
    return 0

"""The server's bound on waiting work: requests it holds that the engine could not be
running (past its running slots, max_num_seqs sequences), and the prompt tokens of those
that have produced no token yet. Past the bound a new request is answered at once with
429 and a Retry-After header, in OpenAI's error shape, instead of queueing for ever;
nothing admitted is dropped. Counted on the event loop alone, so that concurrent requests
cannot pass it together. (vLLM's --max-num-queued-reqs bounds the requests not yet
scheduled likewise: those running never count.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pyengine.entrypoints.openai.errors import APIError

OVERLOADED = 429
RETRY_AFTER_SECONDS = 1


@dataclass
class Admitted:
    """One admitted prompt's two releases: `started` at its first token (its prompt no
    longer waits), `ended` when it finishes or is aborted (its sequences free their
    slots). Each runs once; `ended` runs `started` too."""

    bound: WaitingBound
    prompt_tokens: int
    sequences: int
    _started: bool = False
    _ended: bool = False

    def started(self) -> None:
        if not self._started:
            self._started = True
            self.bound.requests -= 1
            self.bound.prompt_tokens -= self.prompt_tokens

    def ended(self) -> None:
        self.started()
        if not self._ended:
            self._ended = True
            self.bound.sequences -= self.sequences


@dataclass
class WaitingBound:
    max_requests: int | None = None  # None: no bound
    max_prompt_tokens: int | None = None
    running_slots: int = 0  # max_num_seqs: sequences the engine runs at once
    sequences: int = 0  # admitted and unfinished, n for each prompt
    requests: int = 0  # admitted, no token out yet
    prompt_tokens: int = 0  # theirs
    on_refused: Callable[[], None] | None = None  # (the metrics' counter)

    def admit(self, prompt_lengths: list[int], n: int = 1) -> list[Admitted]:
        """Counts the prompts in (one request each, of n samples); APIError 429 where they
        would pass the bound. Returns each prompt's releases."""
        waiting = max(0, self.sequences + n * len(prompt_lengths) - self.running_slots)
        tokens = self.prompt_tokens + sum(prompt_lengths)
        over = []
        if self.max_requests is not None and waiting > self.max_requests:
            over.append(f"{waiting} requests would wait (at most {self.max_requests})")
        if self.max_prompt_tokens is not None and tokens > self.max_prompt_tokens:
            over.append(f"{tokens} prompt tokens would wait (at most {self.max_prompt_tokens})")
        if over:
            if self.on_refused is not None:
                self.on_refused()
            raise APIError(
                f"the server is overloaded: {'; '.join(over)}; retry later",
                status=OVERLOADED, headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )  # fmt: skip
        self.sequences += n * len(prompt_lengths)
        self.requests += len(prompt_lengths)
        self.prompt_tokens = tokens
        return [Admitted(self, length, n) for length in prompt_lengths]

"""The server's bound on waiting work: requests it holds that have produced no token
yet, and their prompt tokens. Past the bound a new request is answered at once with 429
and a Retry-After header, in OpenAI's error shape, instead of queueing for ever; nothing
admitted is dropped. Counted on the event loop alone, so that concurrent requests cannot
pass it together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pyengine.entrypoints.openai.errors import APIError

OVERLOADED = 429
RETRY_AFTER_SECONDS = 1


@dataclass
class WaitingBound:
    max_requests: int | None = None  # None: no bound
    max_prompt_tokens: int | None = None
    requests: int = 0  # admitted, no token out yet
    prompt_tokens: int = 0
    on_refused: Callable[[], None] | None = None  # (the metrics' counter)

    def admit(self, prompt_lengths: list[int]) -> list[Callable[[], None]]:
        """Counts the prompts in (one request each); APIError 429 where they would pass
        the bound. Returns each prompt's release, called once it starts (or ends)."""
        requests = self.requests + len(prompt_lengths)
        tokens = self.prompt_tokens + sum(prompt_lengths)
        over = []
        if self.max_requests is not None and requests > self.max_requests:
            over.append(f"{requests} requests would wait (at most {self.max_requests})")
        if self.max_prompt_tokens is not None and tokens > self.max_prompt_tokens:
            over.append(f"{tokens} prompt tokens would wait (at most {self.max_prompt_tokens})")
        if over:
            if self.on_refused is not None:
                self.on_refused()
            raise APIError(
                f"the server is overloaded: {'; '.join(over)}; retry later",
                status=OVERLOADED, headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )  # fmt: skip
        self.requests, self.prompt_tokens = requests, tokens
        return [self._release(n) for n in prompt_lengths]

    def _release(self, prompt_tokens: int) -> Callable[[], None]:
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.requests -= 1
                self.prompt_tokens -= prompt_tokens

        return release

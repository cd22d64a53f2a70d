"""The ledger of the commands a distributed executor has sent: each is numbered as it
goes out, and the ranks answer in that order. With a pipeline several steps' commands
are in flight, so an answer that arrives before its caller asks for it is kept until
then; the answer of a command whose step failed is abandoned, and dropped when it
arrives, so that nothing holds it and the executor is idle again afterwards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Reply = tuple[str, Any]  # ("ok", result) or ("error", text)


class NumberedReplies:
    def __init__(self, receive: Callable[[], list[Reply]]) -> None:
        # Every rank's reply to the oldest command still unanswered (it may raise).
        self._receive = receive
        self.num_sent = 0
        self.num_received = 0
        self._kept: dict[int, list[Reply]] = {}  # arrived, not yet asked for
        self._abandoned: set[int] = set()  # not arrived, never to be asked for

    def sent(self) -> int:
        """Numbers a command just sent."""
        self.num_sent += 1
        return self.num_sent - 1

    def replies(self, number: int) -> list[Reply]:
        """Every rank's reply to command `number`, receiving (and keeping) those before
        it; RuntimeError where it was taken already."""
        while number not in self._kept:
            if number < self.num_received:
                raise RuntimeError(f"the answer to command {number} was taken already")
            replies = self._receive()
            arrived, self.num_received = self.num_received, self.num_received + 1
            if arrived == number or arrived not in self._abandoned:
                self._kept[arrived] = replies
            self._abandoned.discard(arrived)
        return self._kept.pop(number)

    def abandon(self, number: int) -> None:
        """Command `number`'s answer will not be asked for: dropped now, or on arrival."""
        if self._kept.pop(number, None) is None and number >= self.num_received:
            self._abandoned.add(number)

    def is_idle(self) -> bool:
        """Whether no answer is still to come, once the abandoned ones next in line
        have arrived (and been dropped)."""
        while self.num_received < self.num_sent and self.num_received in self._abandoned:
            self.replies(self.num_received)
        return self.num_received == self.num_sent

    @property
    def num_kept(self) -> int:
        """Answers arrived and held for a caller."""
        return len(self._kept)

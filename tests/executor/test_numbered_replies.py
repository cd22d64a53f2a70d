"""The distributed executor's ledger of numbered commands: answers kept until asked for,
and a failed step's answers dropped (the bug it fixes: the sample answer of a step whose
forward pass failed was kept forever, and collective_rpc then refused to run)."""

from __future__ import annotations

from collections import deque

import pytest

from pyengine.executor.numbered_replies import NumberedReplies, Reply


class FakeRanks:
    """Answers the oldest command still unanswered with its number."""

    def __init__(self) -> None:
        self.pending: deque[int] = deque()

    def send(self, book: NumberedReplies) -> int:
        number = book.sent()
        self.pending.append(number)
        return number

    def receive(self) -> list[Reply]:
        return [("ok", self.pending.popleft())]


def test_answers_arriving_early_are_kept_until_asked_for() -> None:
    ranks = FakeRanks()
    book = NumberedReplies(ranks.receive)
    first, second = ranks.send(book), ranks.send(book)
    assert book.replies(second) == [("ok", second)]
    assert book.num_kept == 1
    assert book.replies(first) == [("ok", first)]
    assert book.is_idle()
    with pytest.raises(RuntimeError, match="taken already"):
        book.replies(first)


def test_abandoned_answers_are_dropped_and_the_ledger_is_idle_again() -> None:
    ranks = FakeRanks()
    book = NumberedReplies(ranks.receive)
    executed, sampled = ranks.send(book), ranks.send(book)
    book.abandon(sampled)  # the step's forward pass failed: its sampling is never read
    book.abandon(executed)
    assert book.is_idle()  # both arrived and were dropped
    assert book.num_kept == 0 and not ranks.pending


def test_an_abandoned_answer_already_kept_is_released() -> None:
    ranks = FakeRanks()
    book = NumberedReplies(ranks.receive)
    first, second, third = ranks.send(book), ranks.send(book), ranks.send(book)
    assert book.replies(third) == [("ok", third)]  # keeps the first two
    book.abandon(first)
    assert book.num_kept == 1
    book.abandon(second)
    assert book.num_kept == 0 and book.is_idle()


def test_an_abandoned_answer_in_the_way_of_a_wanted_one_is_not_kept() -> None:
    ranks = FakeRanks()
    book = NumberedReplies(ranks.receive)
    dropped, wanted = ranks.send(book), ranks.send(book)
    book.abandon(dropped)
    assert book.replies(wanted) == [("ok", wanted)]
    assert book.num_kept == 0 and book.is_idle()

"""Reasoning apart from the answer (`--reasoning-parser`, vLLM's names): thinking models
write their reasoning between `<think>` and `</think>` before the answer, and clients
want it in `reasoning_content`, the answer alone in `content` (and tool calls parsed
from the answer only).

- `deepseek_r1` (DeepSeek-R1 and its distills): the reasoning runs to `</think>`, whether
  the answer opens with `<think>` or the template opened it in the prompt; an answer
  without `</think>` was cut off while thinking, and is all reasoning.
- `qwen3` (Qwen3, QwQ): reasoning only where the answer opens with `<think>` (up to
  `</think>`, or to its end); an answer that does not open with it is all content
  (thinking off: `enable_thinking=False`).

A parser splits a whole answer (`split`) and follows a streamed one (`stream`): each
piece is looked at once, and what the stream sends adds up to the whole answer's split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pyengine.entrypoints.openai.content_scanners import partial_marker

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Reasoned:
    """An answer's reasoning and content (None where there is none)."""

    reasoning: str | None
    content: str | None


class ReasoningStream(Protocol):
    def feed(self, piece: str, finished: bool) -> Reasoned:
        """The reasoning and content that the answer's next piece lets the stream send
        (at the end, `finished`: all that was held back)."""
        ...


class ReasoningParser(Protocol):
    def split(self, text: str) -> Reasoned: ...

    def stream(self) -> ReasoningStream: ...


def _some(text: str) -> str | None:
    return text or None


class ThinkTagParser:
    """`<think>` ... `</think>` before the answer. `opened`: the reasoning starts with
    the answer whether or not it opens with `<think>` (the template may have opened
    it); else only where it does. An answer without `</think>` is all reasoning, once
    the reasoning started."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened

    def split(self, text: str) -> Reasoned:
        body = text.lstrip()
        opens = body.startswith(START)
        if not (opens or self.opened):
            return Reasoned(None, _some(text))
        reasoning, _, content = (body[len(START) :] if opens else text).partition(END)
        return Reasoned(_some(reasoning), _some(content))

    def stream(self) -> ReasoningStream:
        return ThinkTagStream(self.opened)


class ThinkTagStream:
    """ThinkTagParser's split as the answer grows: its opening held until it tells
    whether `<think>` comes, the reasoning's end held while it could begin `</think>`."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened
        self.phase = "opening"  # then "reasoning", then "content"
        self.held = ""  # the text not sent yet: the opening, or what may begin </think>

    def feed(self, piece: str, finished: bool) -> Reasoned:
        self.held += piece
        if self.phase == "opening":
            body = self.held.lstrip()
            if body.startswith(START):
                self.phase, self.held = "reasoning", body[len(START) :]
            elif START.startswith(body) and not finished:
                return Reasoned(None, None)  # (it may yet open with <think>)
            else:
                self.phase = "reasoning" if self.opened else "content"
        reasoning = ""
        if self.phase == "reasoning":
            before, end, after = self.held.partition(END)
            if end:
                reasoning, self.held, self.phase = before, after, "content"
            else:
                keep = 0 if finished else partial_marker(self.held, END)
                cut = len(self.held) - keep
                reasoning, self.held = self.held[:cut], self.held[cut:]
        content = ""
        if self.phase == "content":
            content, self.held = self.held, ""
        return Reasoned(_some(reasoning), _some(content))


REASONING_PARSERS = {
    "deepseek_r1": lambda: ThinkTagParser(opened=True),
    "qwen3": lambda: ThinkTagParser(opened=False),
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser of `--reasoning-parser name`; ValueError naming the known ones."""
    make = REASONING_PARSERS.get(name)
    if make is None:
        raise ValueError(
            f"--reasoning-parser {name!r} is not one of {', '.join(sorted(REASONING_PARSERS))}"
        )
    return make()

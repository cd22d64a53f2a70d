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
- `gpt_oss` (OpenAI's harmony format): the answer is messages, each a header
  (`<|channel|>analysis`, `final`, `commentary`...) then `<|message|>` and its text to
  `<|end|>`, `<|return|>` or `<|call|>`, the next one after `<|start|>assistant`. The
  analysis channel is the reasoning, the others the content; a message to a function
  (`to=functions.name` in its header) stays in the content as
  `<|channel|>commentary to=functions.name<|message|>{...}<|call|>`, which the `openai`
  tool parser reads. Its markers are special tokens, which the server keeps in the text
  for it; an answer without them is all content.

A parser splits a whole answer (`split`) and follows a streamed one (`stream`): each
piece is looked at once, and what the stream sends adds up to the whole answer's split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pyengine.entrypoints.openai.content_scanners import partial_marker
from pyengine.utils.registry import make_named

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
    # The text that ends the reasoning (the engine's thinking_end_token_ids, tokenized)
    end: str
    # Whether its markers are special tokens, which the answer's text must keep
    needs_special_tokens: bool

    def split(self, text: str) -> Reasoned: ...

    def stream(self) -> ReasoningStream: ...

    def thinks_after(self, prompt: str) -> bool:
        """Whether the model, given this prompt, reasons before it answers: not where the
        prompt ends by closing its thinking (a template's empty block, thinking off)."""
        ...


def _some(text: str) -> str | None:
    return text or None


class ThinkTagParser:
    """`<think>` ... `</think>` before the answer. `opened`: the reasoning starts with
    the answer whether or not it opens with `<think>` (the template may have opened
    it); else only where it does. An answer without `</think>` is all reasoning, once
    the reasoning started."""

    end = END
    needs_special_tokens = False

    def __init__(self, opened: bool) -> None:
        self.opened = opened

    def thinks_after(self, prompt: str) -> bool:
        # (only its end: earlier turns may hold their reasoning, closed)
        return not prompt.rstrip().endswith(END)

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


CHANNEL, MESSAGE, MESSAGE_START = "<|channel|>", "<|message|>", "<|start|>"
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")
# A message to a function, as the content carries it for the `openai` tool parser
CALL_OPEN, CALL_END = "<|channel|>commentary to=", "<|call|>"


class HarmonyParser:
    """gpt-oss's harmony messages: the analysis channel's text is the reasoning."""

    # (the analysis message's end, and the final message's header: what the model writes
    # between its reasoning and its answer, and what a spent budget writes for it)
    end = "<|end|><|start|>assistant<|channel|>final<|message|>"
    needs_special_tokens = True

    def thinks_after(self, prompt: str) -> bool:
        return True  # (every answer opens with its analysis)

    def split(self, text: str) -> Reasoned:
        return HarmonyStream().feed(text, finished=True)

    def stream(self) -> ReasoningStream:
        return HarmonyStream()


class HarmonyStream:
    """The messages as the answer grows: a header held until its `<|message|>`, a
    message's text held while its end could begin a marker."""

    def __init__(self) -> None:
        self.phase = "opening"  # then "header", "body", "between"; or "plain"
        self.held = ""
        self.reasoning = False  # (the open message's channel is analysis)
        self.call = False  # (the open message is to a function: its end goes out too)

    def feed(self, piece: str, finished: bool) -> Reasoned:
        self.held += piece
        reasoning: list[str] = []
        content: list[str] = []
        while self._advance(finished, reasoning, content):
            pass
        return Reasoned(_some("".join(reasoning)), _some("".join(content)))

    def _advance(self, finished: bool, reasoning: list[str], content: list[str]) -> bool:
        """One move of the state machine; False once it must wait for more text."""
        if self.phase == "opening":
            body = self.held.lstrip()
            if body.startswith((CHANNEL, MESSAGE_START)):
                self.phase, self.held = "header", body
            elif (CHANNEL.startswith(body) or MESSAGE_START.startswith(body)) and not finished:
                return False  # (it may yet open with a header)
            else:
                self.phase = "plain"
            return True
        if self.phase == "plain":
            content.append(self.held)
            self.held = ""
            return False
        if self.phase == "header":
            at = self.held.find(MESSAGE)
            if at < 0:
                self.held = "" if finished else self.held  # (a header cut off shows nothing)
                return False
            header, self.held = self.held[:at], self.held[at + len(MESSAGE) :]
            channel = header.partition(CHANNEL)[2].split(" ")[0] if CHANNEL in header else ""
            self.reasoning, self.phase = channel == "analysis", "body"
            recipient = header.partition(" to=")[2].split(" ")[0].split("<|")[0]
            self.call = recipient.startswith("functions.") and not self.reasoning
            if self.call:
                content.append(f"{CALL_OPEN}{recipient}{MESSAGE}")
            return True
        if self.phase == "body":
            into = reasoning if self.reasoning else content
            ends = [(self.held.find(m), m) for m in MESSAGE_ENDS if m in self.held]
            if ends:
                at, marker = min(ends)
                into.append(self.held[:at] + (CALL_END if self.call else ""))
                self.held, self.phase = self.held[at + len(marker) :], "between"
                return True
            keep = 0 if finished else max(partial_marker(self.held, m) for m in MESSAGE_ENDS)
            cut = len(self.held) - keep
            into.append(self.held[:cut])
            self.held = self.held[cut:]
            return False
        # between messages: the next one's header after <|start|> (anything else dropped)
        at = self.held.find(MESSAGE_START)
        if at < 0:
            keep = 0 if finished else partial_marker(self.held, MESSAGE_START)
            self.held = self.held[len(self.held) - keep :]
            return False
        self.held, self.phase = self.held[at + len(MESSAGE_START) :], "header"
        return True


REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "deepseek_r1": lambda: ThinkTagParser(opened=True),
    "qwen3": lambda: ThinkTagParser(opened=False),
    "gpt_oss": HarmonyParser,
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser of `--reasoning-parser name`; ValueError naming the known ones."""
    return make_named(REASONING_PARSERS, name, "--reasoning-parser")

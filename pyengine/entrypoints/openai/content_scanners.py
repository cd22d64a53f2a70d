"""How much of a streamed answer is surely content (no tool call can start in it),
followed as the answer grows: each piece is looked at once, with a few characters of
what came before, so that a stream's cost stays linear in its length (scanning the whole
text again at every token made it quadratic). A parser (tool_parsers.py) gives the
scanner of its format."""

from __future__ import annotations

from typing import Protocol


class ContentScanner(Protocol):
    def feed(self, piece: str) -> int:
        """Adds the answer's next piece; the length of its first part that is content
        whatever follows."""
        ...


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that `marker` starts with."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class MarkerScanner:
    """Content ends where `marker` first starts (Hermes' blocks), or, until it does,
    before an end of the text that could begin it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.length = 0
        self.tail = ""  # the text's last characters: a marker may span pieces
        self.found: int | None = None

    def feed(self, piece: str) -> int:
        if self.found is None:
            window = self.tail + piece
            at = window.find(self.marker)
            if at >= 0:
                self.found = self.length - len(self.tail) + at
            else:
                self.tail = window[max(0, len(window) - (len(self.marker) - 1)) :]
        self.length += len(piece)
        if self.found is not None:
            return self.found
        return self.length - partial_marker(self.tail, self.marker)


class WholeAnswerScanner:
    """Formats whose calls are the whole answer: none of it is content while it is blank
    or begins as one of `openers` may; once its first characters tell, all of it is
    content, or none."""

    def __init__(self, openers: tuple[str, ...]) -> None:
        self.openers = openers
        self.width = max(map(len, openers))
        self.length = 0
        self.head = ""  # the answer's first characters, after its leading blanks
        self.content: bool | None = None  # (None: not told yet)

    def feed(self, piece: str) -> int:
        self.length += len(piece)
        if self.content is None:
            self.head = (self.head + piece).lstrip()[: self.width]
            body = self.head
            if body and not any(o.startswith(body[: len(o)]) for o in self.openers):
                self.content = True
            elif len(body) >= self.width:
                self.content = False
        return self.length if self.content else 0

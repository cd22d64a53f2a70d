"""Incremental detokenization: the text a stream of generated tokens adds, token by token,
without decoding the whole output again each time; the stop strings found in it; and the
text a stream may hand out so far, holding back what could still begin a stop string."""

from __future__ import annotations

from pyengine.sampling_params import SamplingParams
from pyengine.tokenizer import PyengineTokenizer

# A piece of a UTF-8 character that later tokens complete decodes to this.
_INCOMPLETE = "\ufffd"
# A UTF-8 character has at most 4 bytes: text still cut after this many tokens never
# completes (invalid bytes a biased or hostile request makes the model write). It is
# emitted as it decodes: the window stays short instead of growing with every token.
MAX_PENDING_TOKENS = 8


class GrowingText:
    """A text that grows at its end, kept as the pieces it grew by, so that growing it
    and reading its last characters cost what was added or read, not its whole length
    (a `str` attribute extended with `+=` is copied whole each time)."""

    def __init__(self, text: str = "") -> None:
        self._pieces: list[str] = [text] if text else []
        self.length = len(text)

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self.length += len(piece)

    def since(self, start: int) -> str:
        """text[start:], joining only the pieces it takes."""
        at, i = self.length, len(self._pieces)
        while at > start and i > 0:
            i -= 1
            at -= len(self._pieces[i])
        if i == len(self._pieces):
            return ""
        return self._pieces[i][start - at :] + "".join(self._pieces[i + 1 :])

    def cut(self, end: int) -> None:
        """Ends the text at `end` (a place in its last few pieces)."""
        while self.length > end:
            last = self._pieces.pop()
            self.length -= len(last)
            self.append(last[: max(0, end - self.length)])

    def whole(self) -> str:
        """The whole text (joined once: later reads start from the joined piece)."""
        text = "".join(self._pieces)
        self._pieces = [text] if text else []
        return text


class IncrementalDetokenizer:
    """Decodes only a short window: the tokens since the last emitted text, after a few
    tokens of context. The window's context is decoded on its own too, and only what the
    new tokens add to it is emitted, so tokenizer quirks at the window's start (a
    dropped leading space) cancel out.

    It also finds the request's stop strings as the text grows and ends the text at the
    first one, and it hands out the text in deltas (`take_new_text`): text that could still
    turn out to begin a stop string is held back until it cannot, and the text the
    finished output ends with is whole."""

    def __init__(self, tokenizer: PyengineTokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings = params.stop_strings
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # A stop string's first characters could be the text's last ones: a delta keeps
        # back up to one fewer characters than the longest stop string.
        self.hold_back = max(map(len, self.stop_strings), default=1) - 1
        self._text = GrowingText()
        self._prefix_offset = 0  # the window's context starts here
        self._read_offset = 0  # tokens before this have had their text emitted
        self._num_sent_chars = 0  # the text that deltas have handed out

    @property
    def text(self) -> str:
        """The whole text so far (a copy of all of it: for whole outputs)."""
        return self._text.whole()

    def add(self, token_ids: list[int]) -> str | None:
        """Decodes the text that the last of `token_ids` (the sample's tokens so far)
        adds. Returns the stop string the text now holds, if any: the text then ends
        before it, or after it with include_stop_str_in_output."""
        window = token_ids[self._prefix_offset :]
        context = self.tokenizer.decode(
            window[: self._read_offset - self._prefix_offset], self.skip_special_tokens
        )
        full = self.tokenizer.decode(window, self.skip_special_tokens)
        if full.endswith(_INCOMPLETE) and len(token_ids) - self._read_offset < MAX_PENDING_TOKENS:
            return None  # a character is cut: its text comes with a later token
        new_from = self._text.length
        self._text.append(full[len(context) :])
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        return self._find_stop_string(new_from) if self.stop_strings else None

    def _find_stop_string(self, new_from: int) -> str | None:
        """Ends the text at the first stop string that overlaps its text from `new_from`
        on (what the last token added; a token can add any number of characters)."""
        start = max(0, new_from - self.hold_back)  # (the longest stop string's length - 1)
        tail = self._text.since(start)
        hits = [(tail.find(s), s) for s in self.stop_strings]
        hits = [(at, s) for at, s in hits if at >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        self._text.cut(start + at + (len(stop) if self.include_stop_str_in_output else 0))
        return stop

    def finish(self, token_ids: list[int]) -> None:
        """The final text: `token_ids` decoded whole (once, as the sample finishes)."""
        self._text = GrowingText(self.tokenizer.decode(token_ids, self.skip_special_tokens))

    def take_new_text(self, finished: bool) -> str:
        """The text since the last call: all of it once the sample has finished, until
        then all but the last `hold_back` characters."""
        sent, length = self._num_sent_chars, self._text.length
        end = length if finished else max(sent, length - self.hold_back)
        self._num_sent_chars = end
        return self._text.since(sent)[: end - sent] if end > sent else ""

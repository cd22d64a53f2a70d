"""Incremental detokenization: the text a stream of generated tokens adds, token by token,
without decoding the whole output again each time."""

from __future__ import annotations

from pyengine.tokenizer import PyengineTokenizer

# A piece of a UTF-8 character that later tokens complete decodes to this.
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Decodes only a short window: the tokens since the last emitted text, after a few
    tokens of context. The window's context is decoded on its own too, and only what the
    new tokens add to it is emitted, so tokenizer quirks at the window's start (a
    dropped leading space) cancel out."""

    def __init__(self, tokenizer: PyengineTokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # the window's context starts here
        self._read_offset = 0  # tokens before this have had their text emitted

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it completes ("" while a character is cut)."""
        self.token_ids.append(token_id)
        window = self.token_ids[self._prefix_offset :]
        context = self.tokenizer.decode(
            window[: self._read_offset - self._prefix_offset], self.skip_special_tokens
        )
        full = self.tokenizer.decode(window, self.skip_special_tokens)
        if full.endswith(_INCOMPLETE):
            return ""
        delta = full[len(context) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta

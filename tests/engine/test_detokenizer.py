"""The incremental detokenizer on output that never completes a character: bytes that
begin a 4-byte UTF-8 sequence, one after another (what a logit_bias of +100 on a byte
token makes a model write). Its window stays short and the text keeps coming, instead of
every token decoding all the pending ones again."""

from __future__ import annotations

from pyengine.engine.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer
from pyengine.loader.resolve import DEFAULT_MODEL, load_model
from pyengine.sampling_params import SamplingParams


class CountingTokenizer:
    """The default model's tokenizer, counting the tokens each decode is handed."""

    def __init__(self) -> None:
        self.inner = load_model(DEFAULT_MODEL, read_weights=False).tokenizer
        self.longest = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(token_ids))
        return self.inner.decode(token_ids, skip_special_tokens)  # type: ignore[no-any-return]


def test_invalid_bytes_are_emitted_after_a_bounded_wait() -> None:
    tokenizer = CountingTokenizer()
    lead = next(t for t in range(512) if tokenizer.inner.token_bytes(t) == b"\xf0")
    detokenizer = IncrementalDetokenizer(tokenizer, SamplingParams())  # type: ignore[arg-type]
    tokens: list[int] = []
    emitted = []
    for _ in range(200):
        tokens.append(lead)
        detokenizer.add(tokens)
        emitted.append(detokenizer.take_new_text(finished=False))
    assert tokenizer.longest <= 2 * MAX_PENDING_TOKENS  # (the context, then the pending)
    text = "".join(emitted)
    assert len(text) >= 200 - MAX_PENDING_TOKENS and set(text) == {"\ufffd"}
    detokenizer.finish(tokens)  # the whole text, decoded once, agrees
    assert detokenizer.text == tokenizer.inner.decode(tokens)


def test_a_character_split_over_tokens_still_waits_for_its_end() -> None:
    tokenizer = CountingTokenizer()
    tokens = tokenizer.inner.encode("a 😀 b", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, SamplingParams())  # type: ignore[arg-type]
    pieces = []
    for i in range(1, len(tokens) + 1):
        detokenizer.add(tokens[:i])
        pieces.append(detokenizer.take_new_text(finished=False))
    assert "".join(pieces) == "a 😀 b" and "\ufffd" not in "".join(pieces)

"""The reasoning parsers (entrypoints/openai/reasoning_parsers.py) on answers as thinking
models write them: whole, and streamed in pieces cut at random (the pieces' reasoning
and content add up to the whole answer's split, `<think>` and `</think>` cut through
too); an answer cut off while thinking, one with thinking off, and unknown names."""

from __future__ import annotations

import random

import pytest

from pyengine.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    Reasoned,
    reasoning_parser,
)

THOUGHT = "The user asks for 2 + 2.\nThat is 4; no <thin trick here </thi either."
ANSWER = "\n\n2 + 2 = 4."
# (answer, deepseek_r1's split, qwen3's split)
CASES = [
    (f"<think>\n{THOUGHT}\n</think>{ANSWER}", Reasoned(f"\n{THOUGHT}\n", ANSWER),
     Reasoned(f"\n{THOUGHT}\n", ANSWER)),
    (f"  <think>{THOUGHT}</think>{ANSWER}", Reasoned(THOUGHT, ANSWER), Reasoned(THOUGHT, ANSWER)),
    # (the template opened <think>: DeepSeek-R1's reasoning runs from the answer's start)
    (f"{THOUGHT}</think>{ANSWER}", Reasoned(THOUGHT, ANSWER),
     Reasoned(None, f"{THOUGHT}</think>{ANSWER}")),
    # (cut off while thinking)
    (f"<think>{THOUGHT}", Reasoned(THOUGHT, None), Reasoned(THOUGHT, None)),
    # (thinking off)
    (ANSWER, Reasoned(ANSWER, None), Reasoned(None, ANSWER)),
    ("<think></think>", Reasoned(None, None), Reasoned(None, None)),
    ("<thi", Reasoned("<thi", None), Reasoned(None, "<thi")),
    ("", Reasoned(None, None), Reasoned(None, None)),
]  # fmt: skip


def streamed(name: str, text: str, rng: random.Random) -> Reasoned:
    """The text fed in random pieces (some empty), the sent parts joined."""
    stream = reasoning_parser(name).stream()
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    reasoning, content = [], []
    for k, piece in enumerate(pieces):
        sent = stream.feed(piece, finished=k == len(pieces) - 1)
        reasoning.append(sent.reasoning or "")
        content.append(sent.content or "")
    return Reasoned("".join(reasoning) or None, "".join(content) or None)


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_whole_and_streamed_answers_split_alike(name: str) -> None:
    rng = random.Random()
    for text, deepseek, qwen in CASES:
        want = deepseek if name == "deepseek_r1" else qwen
        assert reasoning_parser(name).split(text) == want, text
        for _ in range(30):
            assert streamed(name, text, rng) == want, text


def test_a_stream_holds_only_what_may_begin_a_marker() -> None:
    """Reasoning goes out as it comes but for an end that may begin </think>; the
    content goes out at once."""
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("<th", False) == Reasoned(None, None)
    assert stream.feed("ink>Let me see</", False) == Reasoned("Let me see", None)
    assert stream.feed("think>Four", False) == Reasoned(None, "Four")
    assert stream.feed(".", True) == Reasoned(None, ".")


def test_unknown_parsers_are_named() -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "gpt_oss", "qwen3"]
    with pytest.raises(ValueError, match="'granite' is not one of deepseek_r1, gpt_oss, qwen3"):
        reasoning_parser("granite")


HARMONY = [
    # (analysis, then the final answer)
    ("<|channel|>analysis<|message|>User asks 2+2. <|end is not a marker|>Simple.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
     Reasoned("User asks 2+2. <|end is not a marker|>Simple.", "2 + 2 = 4.")),
    # (two analysis messages around a commentary preamble; the final one cut off)
    ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>commentary"
     "<|message|>Checking.<|end|><|start|>assistant<|channel|>analysis<|message|> Second."
     "<|end|><|start|>assistant<|channel|>final<|message|>Done",
     Reasoned("First. Second.", "Checking.Done")),
    # (cut off while thinking; a header cut off)
    ("<|channel|>analysis<|message|>Hmm", Reasoned("Hmm", None)),
    ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|chan",
     Reasoned("Hmm.", None)),
    # (the special tokens skipped: all content)
    ("analysisHmm.assistantfinal4", Reasoned(None, "analysisHmm.assistantfinal4")),
    ("<|chan", Reasoned(None, "<|chan")),
    ("", Reasoned(None, None)),
]  # fmt: skip


def test_a_prompt_that_closed_its_thinking_is_not_thinking() -> None:
    parser = reasoning_parser("qwen3")
    assert parser.thinks_after("<|im_start|>assistant\n")
    assert not parser.thinks_after("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # (an earlier turn's reasoning, closed, does not end the prompt)
    assert parser.thinks_after("<think>x</think>Paris.<|im_end|>\n<|im_start|>assistant\n")
    assert reasoning_parser("deepseek_r1").thinks_after("<|Assistant|><think>\n")


def test_harmony_messages_split_whole_and_streamed() -> None:
    rng = random.Random()
    for text, want in HARMONY:
        assert reasoning_parser("gpt_oss").split(text) == want, text
        for _ in range(40):
            assert streamed("gpt_oss", text, rng) == want, text

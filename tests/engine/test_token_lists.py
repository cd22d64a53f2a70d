"""vLLM's sampling fields on the default model: allowed_token_ids (every token one of
them, the greedy pick the best of them), bad_words (a word the greedy answer wrote is
never written again, at the text's start or after a space, and a word of several
tokens only where its last token would complete it), truncate_prompt_tokens (the
answer of the prompt's last tokens alone), each refused by name where malformed; and
the server's fields reaching the SamplingParams."""

from __future__ import annotations

import pytest
from helpers.smollm2 import default_llm

from pyengine import LLM, SamplingParams
from pyengine.entrypoints.openai.protocol import CompletionRequest

PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return default_llm(max_model_len=512)  # type: ignore[no-any-return]


def greedy(llm: LLM, prompt: str | list[int] = PROMPT, **fields: object) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **fields)  # type: ignore[arg-type]
    given = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    (out,) = llm.generate([given], params, use_tqdm=False)  # type: ignore[list-item]
    return list(out.outputs[0].token_ids)


def test_allowed_token_ids_keep_every_token_among_them(llm: LLM) -> None:
    free = greedy(llm)
    allowed = [free[0], free[0] + 1, 13]
    tokens = greedy(llm, allowed_token_ids=allowed)
    assert set(tokens) <= set(allowed) and tokens[0] == free[0]


def test_bad_words_are_never_written(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    free = greedy(llm)
    word = tokenizer.decode(free).split()[0]
    tokens = greedy(llm, bad_words=[word])
    assert tokens != free
    for text in (word, " " + word):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert not any(tokens[i : i + len(ids)] == ids for i in range(len(tokens))), text
    # (a word of two tokens bans its second where the first came: the first stays free)
    first, second = free[0], free[1]
    tokens = greedy(llm, bad_words_token_ids=[[first, second]])
    assert tokens[0] == first and tokens[1] != second


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    assert greedy(llm, ids, truncate_prompt_tokens=6) == greedy(llm, ids[-6:])
    params = SamplingParams(max_tokens=1, truncate_prompt_tokens=6)
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    assert list(out.prompt_token_ids) == ids[-6:]


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_malformed_fields_are_named(llm: LLM, fields: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        greedy(llm, **fields)


def test_the_servers_fields_reach_the_sampling_params() -> None:
    request = CompletionRequest(prompt="hi", allowed_token_ids=[1, 2], bad_words=["no"],
                                truncate_prompt_tokens=4)  # fmt: skip
    params = request.to_sampling_params()
    assert (params.allowed_token_ids, params.bad_words, params.truncate_prompt_tokens) == (
        [1, 2], ["no"], 4,
    )  # fmt: skip

"""Prompt lookup (`_C.propose_ngram`, cpp/include/pyengine/ngram_proposer.h) against a
direct Python reading of its definition, on random token sequences of a small
vocabulary (so that suffixes repeat), and its bad configurations refused."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine import _C


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_propose_ngram_matches_its_definition() -> None:
    rng = np.random.default_rng()
    for _ in range(2000):
        tokens = rng.integers(0, int(rng.integers(2, 8)), int(rng.integers(0, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        assert _C.propose_ngram(tokens, min_n, max_n, k) == reference(tokens, min_n, max_n, k)


@pytest.mark.parametrize(
    ("args", "message"),
    [((0, 2, 1), "prompt_lookup_min must be at least 1"),
     ((3, 2, 1), "prompt_lookup_max must be at least prompt_lookup_min"),
     ((1, 2, 0), "num_speculative_tokens must be at least 1")],
)  # fmt: skip
def test_bad_configs_are_refused(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _C.propose_ngram([1, 2, 1], *args)

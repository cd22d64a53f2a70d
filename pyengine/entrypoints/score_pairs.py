"""What LLM.score and the server's /v1/score and /v1/rerank share: the (query, document)
pairs a request names, and an embedder's score of a pair (the cosine of their
embeddings; a cross-encoder scores a pair by reading both texts at once)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def score_pairs(first: str | Sequence[str], second: str | Sequence[str]) -> list[tuple[str, str]]:
    """Pairs of one text and each of several (1 to N), or of texts side by side (N to
    N); ValueError for lists of different lengths, none, or what is not text."""
    firsts = [first] if isinstance(first, str) else list(first)
    seconds = [second] if isinstance(second, str) else list(second)
    for texts in (firsts, seconds):
        if not texts:
            raise ValueError("scoring needs at least one text on each side")
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("scoring takes texts (strings)")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(
            f"{len(firsts)} first texts and {len(seconds)} second texts: give one first text, "
            "or as many as the second"
        )
    return list(zip(firsts, seconds, strict=True))


def distinct_texts(pairs: list[tuple[str, str]]) -> list[str]:
    """The pairs' texts, each once (what an embedder embeds to score them)."""
    return list(dict.fromkeys(t for pair in pairs for t in pair))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two embeddings (0 where either is all zeros)."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norms if norms else 0.0

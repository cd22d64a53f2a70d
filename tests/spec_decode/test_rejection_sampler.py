"""The rejection sampler of speculative decoding alone (tests/helpers/rejection.py): the
exact distribution of its tokens, enumerated over its choices, is the target's for any
drafts and draft distributions; seeded samples match it within a chi-square bound; bad
shapes are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.rejection import rejection_sample


def random_distribution(rng: np.random.Generator, vocab: int) -> np.ndarray:
    p = rng.random(vocab) ** 3  # uneven, some tokens nearly impossible
    return p / p.sum()


def exact_first(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """P(the sampler's first token is t) when its draft is drawn from q (one-hot: a certain
    draft), by the algebra of its choices: accepted with min(1, p(x) / q(x)), else a token
    of the residual: the reference the sampler is checked against."""
    residual = np.maximum(p - q, 0.0)
    residual = residual / residual.sum() if residual.sum() > 0 else p
    out = np.zeros_like(p)
    for x in np.flatnonzero(q):
        accept = min(1.0, p[x] / q[x])
        out[x] += q[x] * accept
        out += q[x] * (1 - accept) * residual
    return out


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_the_rule_gives_the_target_distribution(with_draft_probs: bool) -> None:
    rng = np.random.default_rng()
    vocab = 6
    for _ in range(50):
        p = random_distribution(rng, vocab)
        q = (
            random_distribution(rng, vocab)
            if with_draft_probs
            else np.eye(vocab)[rng.integers(vocab)]
        )
        np.testing.assert_allclose(exact_first(p, q), p, atol=1e-12)


class Scripted:
    """A generator whose uniforms are given in turn (rejection_sample draws only these)."""

    def __init__(self, *uniforms: float) -> None:
        self.uniforms = list(uniforms)

    def random(self) -> float:
        return self.uniforms.pop(0)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_the_sampler_makes_the_rules_choices(with_draft_probs: bool) -> None:
    """Against the rule above, exactly: accepted below min(1, p / q), rejected above, and a
    rejected draft's token the one whose residual CDF interval holds the uniform."""
    rng = np.random.default_rng()
    vocab = 6
    for _ in range(30):
        target = np.stack([random_distribution(rng, vocab) for _ in range(2)])
        x = int(rng.integers(vocab))
        q = random_distribution(rng, vocab) if with_draft_probs else np.eye(vocab)[x]
        probs = q[None] if with_draft_probs else None
        accept = min(1.0, target[0, x] / q[x])
        residual = np.maximum(target[0] - q, 0.0)
        if accept > 1e-9:
            got = rejection_sample(target, np.array([x]), Scripted(accept * 0.999, 0.5), probs)  # type: ignore[arg-type]
            assert got[0] == x and len(got) == 2
        if accept < 1 and residual.sum() > 0:
            cdf = np.cumsum(residual / residual.sum())
            for t in np.flatnonzero(residual > 1e-9):
                middle = (cdf[t] + (cdf[t - 1] if t else 0.0)) / 2
                u = accept + (1 - accept) * 0.5
                got = rejection_sample(target, np.array([x]), Scripted(u, middle), probs)  # type: ignore[arg-type]
                assert got.tolist() == [t]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # never a token of probability 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_seeded_samples_match_the_target_within_a_chi_square_bound(
    with_draft_probs: bool,
) -> None:
    """8000 seeded rows of 3 drafts (certain ones, or each drawn from its proposer's
    distribution): the first token's histogram against the target at the row's last
    token, and the second's (rows that accepted the first draft) against the target after
    it. The bound, 30 for 7 degrees of freedom, is exceeded by chance with probability
    below 1e-4."""
    rng = np.random.default_rng(1234)
    vocab = 8
    target = np.stack([random_distribution(rng, vocab) for _ in range(4)])
    target[1, 5] = 0.0  # a token the target never takes after the first draft
    target[1] /= target[1].sum()
    drafts = np.array([2, 5, 1])
    draft_probs = (
        np.stack([random_distribution(rng, vocab) for _ in range(3)]) if with_draft_probs else None
    )
    first = np.zeros(vocab)
    second = np.zeros(vocab)
    for _ in range(8000):
        if draft_probs is not None:
            drafts = np.array([rng.choice(vocab, p=q) for q in draft_probs])
        tokens = rejection_sample(target, drafts, rng, draft_probs)
        assert 1 <= len(tokens) <= 4
        assert np.array_equal(tokens[:-1], drafts[: len(tokens) - 1])  # accepted drafts
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    assert chi_square(first, target[0]) < 30
    assert chi_square(second, target[1]) < 30  # (given the first draft, whatever it was)
    assert second[5] == 0  # a token the target cannot take is never accepted or drawn


def test_certain_drafts_the_target_agrees_with_are_always_accepted() -> None:
    rng = np.random.default_rng()
    target = np.zeros((3, 4))
    target[0, 1] = target[1, 3] = target[2, 0] = 1.0
    for _ in range(20):
        assert rejection_sample(target, np.array([1, 3]), rng).tolist() == [1, 3, 0]
    assert rejection_sample(target, np.array([2, 3]), rng).tolist() == [1]


def test_the_same_seed_gives_the_same_tokens() -> None:
    rng = np.random.default_rng(5)
    target = np.stack([random_distribution(rng, 10) for _ in range(5)])
    drafts = np.array([3, 3, 7, 1])
    runs = [
        [rejection_sample(target, drafts, g).tolist() for _ in range(50)]
        for g in (np.random.default_rng(99), np.random.default_rng(99))
    ]
    assert runs[0] == runs[1]


def test_bad_shapes_are_clear_errors() -> None:
    rng = np.random.default_rng()
    with pytest.raises(ValueError, match="need \\[3, vocab\\]"):
        rejection_sample(np.full((2, 4), 0.25), np.array([1, 2]), rng)
    with pytest.raises(ValueError, match="draft_probs of shape"):
        rejection_sample(np.full((3, 4), 0.25), np.array([1, 2]), rng, np.ones((2, 3)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rejection_sample(np.full((3, 4), 0.25), np.array([1, 4]), rng)

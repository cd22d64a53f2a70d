"""Rejection sampling of one row's draft tokens (Leviathan et al., Chen et al.): draft i
is accepted with probability min(1, p_i(x) / q_i(x)), p the target's distribution at its
place and q the proposer's; at the first rejection a token is drawn from the residual,
max(0, p_i - q_i) normalized; after all are accepted, one more from the target's
distribution after the last. The tokens then follow the target's distribution exactly,
whatever the drafts. A proposer without a distribution (prompt lookup, suffix) proposes
its token with certainty: q is one-hot, the acceptance p_i(x), the residual p_i without
x."""

from __future__ import annotations

import numpy as np


def rejection_sample(
    target_probs: np.ndarray,
    drafts: np.ndarray,
    rng: np.random.Generator,
    draft_probs: np.ndarray | None = None,
) -> np.ndarray:
    """The row's new tokens: its accepted drafts, then one token drawn as above.

    target_probs: [k + 1, vocab], the target's distribution at the row's last token and
    after each of its k drafts (each row sums to 1). drafts: int [k]. draft_probs:
    [k, vocab], the proposer's distributions, or None for certain (one-hot) drafts."""
    k = len(drafts)
    if target_probs.ndim != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(
            f"rejection_sample: target_probs of shape {target_probs.shape} for {k} drafts "
            f"(need [{k + 1}, vocab])"
        )
    vocab = target_probs.shape[1]
    if draft_probs is not None and draft_probs.shape != (k, vocab):
        raise ValueError(
            f"rejection_sample: draft_probs of shape {draft_probs.shape}, need {(k, vocab)}"
        )
    if k and (drafts.min() < 0 or drafts.max() >= vocab):
        raise ValueError(f"rejection_sample: a draft token outside the vocabulary of {vocab}")
    tokens: list[int] = []
    for i, x in enumerate(drafts.tolist()):
        p = target_probs[i].astype(np.float64)
        if draft_probs is None:
            q = np.zeros(vocab)
            q[x] = 1.0
        else:
            q = draft_probs[i].astype(np.float64)
        accept = 1.0 if q[x] <= p[x] else p[x] / q[x]
        if rng.random() < accept:
            tokens.append(x)
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        # (no mass left, p <= q everywhere, only where p == q: then x is never rejected)
        tokens.append(_draw(residual / total if total > 0 else p, rng))
        return np.asarray(tokens, dtype=np.int32)
    tokens.append(_draw(target_probs[k].astype(np.float64), rng))
    return np.asarray(tokens, dtype=np.int32)


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """A token by inverse CDF of one uniform (the last where rounding leaves it past)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))

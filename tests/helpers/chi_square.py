"""A chi-square goodness-of-fit check for sampling tests: counts against exact
probabilities, and the statistic's bound that chance passes with probability 1e-5."""

from __future__ import annotations

import math

import numpy as np


def chi_square_bound(degrees: int, z: float = 4.265) -> float:
    """The chi-square quantile exceeded by chance with probability 1e-5 (z: the normal's)
    by Wilson and Hilferty's approximation."""
    c = 2 / (9 * degrees)
    return degrees * (1 - c + z * math.sqrt(c)) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """The statistic and its degrees of freedom, cells expecting under 5 pooled."""
    expected = probs.ravel() * counts.sum()
    small = expected < 5
    observed = np.append(counts.ravel()[~small], counts.ravel()[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    return stat, int(keep.sum()) - 1

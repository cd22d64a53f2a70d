"""PoolingParams: what a request of a pooling model (an embedder, a classifier or a
cross-encoder) asks for (as vLLM's), and how a text pair's segments reach an encoder."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

from pyengine.sampling_params import is_int

# What a pooling request asks of the model: an embedding of its text ("embed"), the
# classifier's probabilities ("classify"), or a cross-encoder's relevance score of a
# pair ("score": the classifier's one logit through a sigmoid).
POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """`dimensions`: an embedding's first this many numbers (a Matryoshka model's smaller
    embedding), normalised after the cut; `normalize`: an embedding scaled to unit
    length (None: the model's pooler_config, yes unless it says otherwise);
    `activation`: a classifier's softmax, or a score's sigmoid (None: yes);
    `truncate_prompt_tokens`: only the prompt's first this many tokens (an encoder's
    texts are cut at their end, as sentence-transformers cuts them)."""

    task: str | None = None  # None: "embed", or what LLM.classify / LLM.score ask
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if self.dimensions is not None and self.task not in (None, "embed"):
            raise ValueError(f"dimensions applies to embeddings, not to task {self.task!r}")


# An encoder's second segment (a text pair's second text) is told apart by its token
# type; the engine carries it in the token ids it schedules, above every id a vocabulary
# holds, so that nothing between the request and the model's embeddings carries a
# second array (the request's own prompt_token_ids stay plain). Only pooling requests
# of a pair have such ids.
TOKEN_TYPE_SHIFT = 30
Ids = TypeVar("Ids", "np.ndarray", "torch.Tensor")


def with_token_types(token_ids: Sequence[int], type_ids: Sequence[int]) -> list[int]:
    """The ids with each token's type (0 or 1) in bit TOKEN_TYPE_SHIFT."""
    return [t | (k << TOKEN_TYPE_SHIFT) for t, k in zip(token_ids, type_ids, strict=True)]


def without_token_types(token_ids: Ids) -> tuple[Ids, Ids]:
    """(token ids, token types) of ids that may carry types (an array or a tensor)."""
    return token_ids & ((1 << TOKEN_TYPE_SHIFT) - 1), token_ids >> TOKEN_TYPE_SHIFT

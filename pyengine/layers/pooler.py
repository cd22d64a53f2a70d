"""The pooler of a pooling model (runner "pooling"): a step's final hidden states in, one
vector per request whose prompt ended in the step out. It takes each request's rows
by the pooling type (its last token, its first, or their mean), puts them through the
model's final norm (`pooled_states`), then through its head: none for an embedder, the
classifier for a cross-encoder or classifier (`classify`), or, for a decoder scored by
chosen tokens of its vocabulary (Qwen3-Reranker's "no" and "yes"), those tokens' logits.

Per-request choices (normalising, an embedding's dimensions, the softmax or sigmoid) are
the engine's, made on these float32 numbers as each request asks."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pyengine.config import PoolerConfig


def pooled_requests(query_start_loc: np.ndarray, logits_indices: np.ndarray) -> np.ndarray:
    """The step's requests (indices) whose prompts end in it, in the order of their
    sampled rows: those whose last token row samples."""
    last_rows = {int(end) - 1: i for i, end in enumerate(query_start_loc[1:])}
    return np.array([last_rows[int(row)] for row in logits_indices], dtype=np.int64)


class Pooler:
    """Built on the model (the last pipeline stage's) with its PoolerConfig."""

    def __init__(self, model: Any, config: PoolerConfig) -> None:
        self.model = model
        self.config = config
        classifies = callable(getattr(model, "classify", None))
        if config.task == "classify" and not config.classifier_from_tokens and not classifies:
            raise ValueError(f"{model.config.architecture} has no classifier head")

    def __call__(
        self, hidden: torch.Tensor, query_start_loc: np.ndarray, logits_indices: np.ndarray
    ) -> torch.Tensor:
        """float32 [requests, out] of the requests whose prompts end in the step (one per
        sampled row, in order): each prompt was scheduled whole."""
        requests = pooled_requests(query_start_loc, logits_indices)
        starts = torch.from_numpy(query_start_loc[:-1][requests].astype(np.int64))
        ends = torch.from_numpy(query_start_loc[1:][requests].astype(np.int64))
        c = self.config
        if c.classifier_from_tokens:  # (the LM head applies the final norm itself)
            logits: torch.Tensor = self.model.compute_logits(hidden[ends - 1])
            chosen = logits[:, list(c.classifier_from_tokens)].float()
            if len(c.classifier_from_tokens) == 2:
                return (chosen[:, 1] - chosen[:, 0]).unsqueeze(1)
            return chosen
        states: torch.Tensor
        if c.pooling_type == "mean":
            states = mean_rows(self.model.pooled_states(hidden).float(), starts, ends)
        else:
            rows = ends - 1 if c.pooling_type == "last" else starts
            states = self.model.pooled_states(hidden[rows])
        if c.task == "classify":
            labels: torch.Tensor = self.model.classify(states)
            return labels.float()
        return states.float()


def mean_rows(hidden: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The mean of each [start, end) span of rows of `hidden` (float32)."""
    lengths = ends - starts
    owner = torch.repeat_interleave(torch.arange(len(starts)), lengths)
    rows = torch.cat([torch.arange(int(s), int(e)) for s, e in zip(starts, ends, strict=True)])
    sums = torch.zeros(len(starts), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    sums.index_add_(0, owner.to(hidden.device), hidden[rows.to(hidden.device)])
    return sums / lengths.to(hidden.device, hidden.dtype).unsqueeze(1)

"""The token embedding and the LM head, split over the vocabulary: each rank holds
ceil(vocab / world_size) rows (the last rank's tail zero), looks up the tokens it holds
and sums over the group; the head's logits are gathered and the padding cut."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pyengine.layers.linear import LayerContext, LinearBase, check_shape
from pyengine.utils.lazy_weights import CheckpointTensor, materialize


def _vocab_shard(vocab_size: int, ctx: LayerContext) -> tuple[int, int]:
    """(first token, rows a rank holds)."""
    rows = -(-vocab_size // ctx.tp.world_size)
    return ctx.tp.rank * rows, rows


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, embedding_size: int, ctx: LayerContext) -> None:
        super().__init__()
        self.vocab_size, self.embedding_size = vocab_size, embedding_size
        self.tp = ctx.tp
        self.start, self.rows = _vocab_shard(vocab_size, ctx)
        # In the model's dtype: the checkpoint's rows are converted as they are copied in.
        weight = torch.empty(self.rows, embedding_size, dtype=ctx.placement.dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def weight_loader(self, name: str, loaded: CheckpointTensor) -> None:
        """This rank's rows of the [vocab_size, embedding_size] checkpoint tensor."""
        _load_vocab_rows(name, self.weight, loaded, self.vocab_size, self.start)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # int [num_tokens]
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0))


class ParallelLMHead(LinearBase):
    """Logits [tokens, vocab_size]. Tied to an embedding, it multiplies by the
    embedding's weight (a packed method packs its own copy; torch's shares it)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        ctx: LayerContext,
        checkpoint_names: Sequence[str],
        tied_to: VocabParallelEmbedding | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.start, rows = _vocab_shard(vocab_size, ctx)
        super().__init__(
            hidden_size, vocab_size, hidden_size, rows, False, ctx, checkpoint_names,
            many_rows=False,
        )  # fmt: skip
        if tied_to is not None:
            self.weight = tied_to.weight

    def weight_loader(self, name: str, loaded: CheckpointTensor) -> None:
        _load_vocab_rows(name, self.weight, loaded, self.vocab_size, self.start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if self.tp.world_size == 1:
            return logits
        return self.tp.all_gather(logits)[:, : self.vocab_size]


def stage_lm_head(
    vocab_size: int,
    hidden_size: int,
    ctx: LayerContext,
    checkpoint_names: tuple[str, str],
    tied_to: VocabParallelEmbedding | None,
    tied: bool,
) -> ParallelLMHead | None:
    """The head of the last pipeline stage (None on the others): checkpoint_names
    (tied, untied)[0 if tied else 1]; tied to the embedding where this stage has it."""
    if not ctx.pp.is_last:
        return None
    name = checkpoint_names[0] if tied else checkpoint_names[1]
    return ParallelLMHead(vocab_size, hidden_size, ctx, [name], tied_to=tied_to if tied else None)


def _load_vocab_rows(
    name: str, weight: nn.Parameter, loaded: CheckpointTensor, vocab_size: int, start: int
) -> None:
    rows, size = weight.shape
    check_shape(name, loaded, (vocab_size, size))
    held = max(0, min(rows, vocab_size - start))
    weight.data[:held].copy_(materialize(loaded.narrow(0, start, held)))
    weight.data[held:].zero_()

"""The token embedding and the LM head, split over the vocabulary: each rank holds
ceil(vocab / world_size) rows (the last rank's tail zero), looks up the tokens it holds
and sums over the group; the head's logits are gathered and the padding cut.

On the CPU an embedding may hold no table of its own: it looks its rows up in a packed
form (ops.packed_columns), its GGUF blocks packed as a head's, or the float32 or bfloat16
panels of the head tied to it, so that a tied model keeps one copy of the vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pyengine import ops
from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.linear import LayerContext, LinearBase
from pyengine.layers.quantization.packing import pack_block_quantized
from pyengine.layers.quantization.shards import check_shape
from pyengine.utils.lazy_weights import CheckpointTensor, materialize

# The tables ops.embedding looks rows up in (torch's F.embedding the others').
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class EmbeddingAdapterHook(Protocol):
    """Adds a per-row delta to looked-up rows (LoRA: each row's adapter)."""

    def add_delta(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [tokens, embedding_size], the rows of ids [tokens], + their delta."""
        ...


def _vocab_shard(vocab_size: int, ctx: LayerContext) -> tuple[int, int]:
    """(first token, rows a rank holds)."""
    rows = -(-vocab_size // ctx.tp.world_size)
    return ctx.tp.rank * rows, rows


class VocabParallelEmbedding(nn.Module):
    weight: nn.Parameter  # absent where the rows are looked up in `packed`

    def __init__(
        self,
        vocab_size: int,
        embedding_size: int,
        ctx: LayerContext,
        checkpoint_name: str | None = None,
    ) -> None:
        """`checkpoint_name`: the table's, for a GGUF block form of it to be kept."""
        super().__init__()
        self.vocab_size, self.embedding_size = vocab_size, embedding_size
        self.tp = ctx.tp
        self.start, self.rows = _vocab_shard(vocab_size, ctx)
        methods = ctx.linear_methods
        self.keeps_blocks = ctx.placement.packs_weights and checkpoint_name in (
            methods.block_quantized
        )
        self.blocks: BlockQuantized | None = None
        # The packed [embedding_size, rows] form the rows are looked up in, if any.
        self.packed: torch.Tensor | None = None
        self.adapter: EmbeddingAdapterHook | None = None
        if not self.keeps_blocks:
            # In the model's dtype: the checkpoint's rows are converted as they are copied.
            weight = torch.empty(self.rows, embedding_size, dtype=ctx.placement.dtype)
            self.weight = nn.Parameter(weight, requires_grad=False)

    def weight_loader(self, name: str, loaded: CheckpointTensor) -> None:
        """This rank's rows of the [vocab_size, embedding_size] checkpoint tensor."""
        _load_vocab_rows(name, self.weight, loaded, self.vocab_size, self.start)

    def load_vocab_blocks(self, blocks: BlockQuantized) -> None:
        self.blocks = _vocab_blocks(blocks, self.start, self.rows)

    def process_weights_after_loading(self) -> None:
        if self.blocks is not None:
            self.packed = pack_block_quantized(self.blocks)
            self.blocks = None

    def block_weights(self) -> int:
        """Weights held only as GGUF blocks, which no parameter counts."""
        return self.rows * self.embedding_size if self.keeps_blocks else 0

    def held_tensors(self) -> list[torch.Tensor]:
        """The packed form the rows are looked up in, which is no parameter."""
        return [] if self.packed is None else [self.packed]

    def look_up_in(self, packed: torch.Tensor) -> None:
        """From now on, rows come from `packed` (a tied head's panels of this table)."""
        self.packed = packed
        del self.weight

    @property
    def row_dtype(self) -> torch.dtype:
        """The dtype of the rows it looks up (after process_weights_after_loading)."""
        if self.packed is None:
            return self.weight.dtype
        # (bfloat16 panels' rows are bfloat16s; every other form's widen to float32)
        return torch.bfloat16 if self.packed.dtype == torch.bfloat16 else torch.float32

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            if not ids.is_cpu or self.weight.dtype not in _KERNEL_DTYPES:
                return F.embedding(ids, self.weight)
            rows = torch.empty(ids.shape[0], self.embedding_size, dtype=self.weight.dtype)
            ops.embedding(rows, self.weight, ids)  # (a kernel: recorded decode steps hold it)
            return rows
        out = torch.empty(ids.shape[0], self.embedding_size, dtype=self.row_dtype)
        ops.packed_columns(out, self.packed, ids, self.rows)
        return out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # int [num_tokens]
        if self.tp.world_size == 1:
            h = self._rows(input_ids)
        else:
            local = input_ids - self.start
            outside = (local < 0) | (local >= self.rows)
            h = self._rows(local.masked_fill(outside, 0))
            h = self.tp.all_reduce(h.masked_fill_(outside[:, None], 0))
        return h if self.adapter is None else self.adapter.add_delta(input_ids, h)


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
        self.tied_to = tied_to
        if tied_to is not None and not tied_to.keeps_blocks:
            self.weight = tied_to.weight

    @property
    def keeps_blocks(self) -> bool:
        return self.method.keeps_blocks

    def block_weights(self) -> int:
        # Tied, its weights are the embedding's, counted there.
        return 0 if self.tied_to is not None else super().block_weights()

    def weight_loader(self, name: str, loaded: CheckpointTensor) -> None:
        _load_vocab_rows(name, self.weight, loaded, self.vocab_size, self.start)

    def load_vocab_blocks(self, blocks: BlockQuantized) -> None:
        self.load_blocks(0, _vocab_blocks(blocks, self.start, self.output_size_per_partition))

    def process_weights_after_loading(self) -> None:
        """Tied, one packed form serves both: the embedding's blocks, or this head's float32 or
        bfloat16 panels, in which the embedding then looks its rows up."""
        embedding = self.tied_to
        if embedding is not None and embedding.keeps_blocks:
            assert embedding.packed is not None
            self.method.share_blocks(self, embedding.packed)
            return
        super().process_weights_after_loading()
        panels = self.method.panels(self)
        if embedding is not None and panels is not None and embedding.packed is None:
            embedding.look_up_in(panels)

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


def _vocab_blocks(blocks: BlockQuantized, start: int, rows: int) -> BlockQuantized:
    """Rows [start, start + rows) of a [vocab, size] block form, zero past the vocabulary."""
    held = blocks.rows(start, start + rows)
    missing = rows - held.shape[0]
    if missing == 0:
        return held
    zeros = BlockQuantized(
        np.zeros((missing, held.shape[1]), held.q.dtype),
        np.zeros((missing, held.scale.shape[1]), np.float32),
        np.zeros((missing, held.offset.shape[1]), np.float32),
    )
    return BlockQuantized.stack([held, zeros])

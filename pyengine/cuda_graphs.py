"""CUDA graphs of the decode step: the model's forward for each batch size of a ladder is
captured once, and a step of one query token per request replays the smallest graph
that holds it, padded, then computes the logits of its real rows. A replay costs one
launch instead of several per layer, which is what a decode step of a few requests is
mostly made of on a GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pyengine.attention import AttentionMetadata, KVCache

if TYPE_CHECKING:
    from pyengine import StepBuffers
    from pyengine.model_runner import CausalLM

# Batch sizes captured (vLLM's ladder), up to max_num_seqs; larger batches run eagerly.
MAX_CAPTURED_BATCH = 512
# The context the graphs' attention is launched for (its shape is fixed at capture):
# 8192 / 512 = 16 partitions per (token, head), among which each token's context, of
# any length, is shared evenly.
MAX_SPLIT_CONTEXT = 8192


def capture_sizes(max_num_seqs: int) -> list[int]:
    top = min(max_num_seqs, MAX_CAPTURED_BATCH)
    ladder = [1, 2, 4, *range(8, MAX_CAPTURED_BATCH + 1, 8)]
    return [*(s for s in ladder if s < top), top]


class DecodeGraphs:
    """The graphs and the static buffers they read: token ids, positions, slots, block
    tables, seq_lens and query_start_loc of the largest size; a smaller graph reads their
    first rows. Padding rows write no slot (-1) and attend to one key of a block their
    stale table row names (the kernel reads any out-of-range id as block 0)."""

    def __init__(
        self,
        model: CausalLM,
        caches: list[KVCache],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.caches = caches
        self.sizes = capture_sizes(max_num_seqs)
        self.split_context = min(max_model_len, MAX_SPLIT_CONTEXT)
        device = caches[0][0].device
        largest = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        # int32 as the scheduler writes them: a step's copies convert nothing.
        self.input_ids = torch.zeros(largest, dtype=torch.int32, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's output
        with torch.cuda.device(device):  # torch.cuda.graph captures on the current device
            # Each size once eagerly, on a side stream as torch advises: lazy
            # initialization (cuBLAS handles and workspaces) stays out of the graphs.
            warmup = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            warmup.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(warmup):
                for size in self.sizes:
                    self._forward(size)
            torch.cuda.current_stream(device).wait_stream(warmup)
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):  # the largest first: the rest reuse its memory
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[size] = self._forward(size)
                self.graphs[size] = graph
            # One replay each now, on padding alone (no slot written): the memory the
            # graphs allocate is committed here rather than at the first step.
            for graph in self.graphs.values():
                graph.replay()
            torch.cuda.synchronize(device)

    @torch.inference_mode()
    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_seq_len=self.split_context,  # fixed: so are the graph's launch shapes
            max_query_len=1,
        )
        hidden: torch.Tensor = self.model(
            self.input_ids[:size], self.positions[:size], self.caches, meta
        )
        return hidden

    def run(self, b: StepBuffers) -> torch.Tensor | None:
        """The logits of a decode step by replay, or None where the step is not one (a
        prefill, a request without a query token) or is larger than every graph."""
        n = len(b.seq_lens)
        if n == 0 or n > self.sizes[-1] or len(b.input_ids) != n:
            return None
        rows = np.arange(n)
        if not np.array_equal(b.query_start_loc, np.arange(n + 1)) or not np.array_equal(
            b.logits_indices, rows
        ):
            return None
        size = next(s for s in self.sizes if s >= n)
        width = b.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            return None
        for static, host in (
            (self.input_ids, b.input_ids),
            (self.positions, b.positions),
            (self.slot_mapping, b.slot_mapping),
            (self.seq_lens, b.seq_lens),
        ):
            static[:n].copy_(torch.from_numpy(np.asarray(host)).pin_memory(), non_blocking=True)
        self.block_tables[:n, :width].copy_(
            torch.from_numpy(np.asarray(b.block_tables)).pin_memory(), non_blocking=True
        )
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        self.graphs[size].replay()
        # Eagerly, for the real rows only: one [rows, vocab] buffer per graph would hold
        # gigabytes at a large vocabulary.
        return self.model.compute_logits(self.hidden[size][:n])

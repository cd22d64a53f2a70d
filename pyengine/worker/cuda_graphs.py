"""CUDA graphs of the decode step: the model's forward for each batch size of a ladder is
captured once, and a step of one query token per request replays the smallest graph
that holds it, padded (its inputs uploaded in place, StepInputs), then computes the
logits of its real rows. A replay costs one launch instead of several per layer, which
is what a decode step of a few requests is mostly made of on a GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pyengine.layers.attention import AttentionMetadata, KVCache

if TYPE_CHECKING:
    from pyengine import StepBuffers
    from pyengine.models.interface import CausalLM
    from pyengine.step_values import SchedulerOutput
    from pyengine.worker.step_inputs import StepInputs

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


def graph_size_for(step: StepBuffers | SchedulerOutput, sizes: list[int]) -> int | None:
    """The smallest of `sizes` (ascending) that holds `step`, or None where the
    step is not a decode step (a prefill, a request without a query token) or is larger
    than every size."""
    n = len(step.seq_lens)
    if n == 0 or n > sizes[-1] or len(step.input_ids) != n:
        return None
    rows = np.arange(n)
    if not np.array_equal(step.query_start_loc, np.arange(n + 1)) or not np.array_equal(
        step.logits_indices, rows
    ):
        return None
    return next(s for s in sizes if s >= n)


class DecodeGraphs:
    """The graphs of a ladder of batch sizes. Each reads the first rows of the step
    inputs' device buffer (StepInputs), which every step's upload fills at the same
    addresses; a smaller graph reads fewer rows. Padding rows write no slot (-1) and
    attend to one key of a block their stale table row names (the kernel reads any
    out-of-range id as block 0). `device_bytes`: the device memory the captures took
    (torch's pool, and what the graphs allocate themselves)."""

    def __init__(
        self,
        model: CausalLM,
        caches: list[KVCache],
        inputs: StepInputs,
        sizes: list[int],
        split_context: int,
    ) -> None:
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be distinct, ascending and positive: {sizes}")
        if sizes[-1] > min(inputs.max_num_seqs, inputs.max_num_batched_tokens):
            raise ValueError(f"a graph of {sizes[-1]} rows is larger than the step inputs")
        self.model = model
        self.caches = caches
        self.inputs = inputs
        self.sizes = sizes
        self.split_context = split_context
        device = caches[0][0].device
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
            torch.cuda.synchronize(device)
            # What the device has free before and after: the captures' memory is torch's
            # pool and the graphs' own allocations (the attention's split-K scratch), which
            # torch does not see. Emptied first, as torch.cuda.graph does at entry.
            torch.cuda.empty_cache()
            free_before = torch.cuda.mem_get_info(device)[0]
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
            self.device_bytes = free_before - torch.cuda.mem_get_info(device)[0]

    @torch.inference_mode()
    def _forward(self, size: int) -> torch.Tensor:
        step = self.inputs.views(size, size, size)
        meta = AttentionMetadata(
            slot_mapping=step.slot_mapping,
            block_tables=step.block_tables,
            seq_lens=step.seq_lens,
            query_start_loc=step.query_start_loc,
            max_seq_len=self.split_context,  # fixed: so are the graph's launch shapes
            max_query_len=1,
        )
        hidden = self.model(step.input_ids, step.positions, self.caches, meta)
        assert isinstance(hidden, torch.Tensor)  # graphs run one whole model (no pipeline)
        return hidden

    def size_for(self, step: StepBuffers | SchedulerOutput) -> int | None:
        """The graph that runs `step`, or None (see graph_size_for)."""
        return graph_size_for(step, self.sizes)

    def replay(self, size: int) -> torch.Tensor:
        """Runs the graph of `size` on what the last upload, padded to it, filled; its
        hidden states [size, hidden]."""
        self.graphs[size].replay()
        return self.hidden[size]
